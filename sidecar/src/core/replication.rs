//! Replication: the chunk subscriptions this node holds and serves, the render ghosts it keeps,
//! and the simulation ghosts it pushes to its game (docs/mesh.md#interest-node-level-chunk-subscriptions, #ghosts).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::{ChunkPos, ChunkRect, Pos};
use cellmesh_world::partition::{NodeId, Partition};

use super::authority::Authority;
use super::context::Context;
use super::peers::Mesh;
use super::wire::*;
use crate::config::SidecarConfig;
use crate::model::entities::{EntityChange, EntityTable, EntityUpdate, NewEntity, TickChanges};
use crate::model::fold::Clients;
use crate::model::fold::TickEvent;
use crate::model::ghosts::GhostStep;
use crate::model::ghosts::{GhostRules, SimGhosts};
use crate::model::node_set::NodeSet;
use crate::model::subs::{self, distance_to_area, Subscribers, Subscriptions};

/// Chunks per subscribe message, so a large band fits a frame.
pub(crate) const CHUNKS_PER_MESSAGE: usize = 4096;
/// Once the owner's link is back, a stale ghost its snapshot burst did not refresh goes after
/// this long (the entity left, or went elsewhere).
const STALE_RESYNC_GRACE_MS: u64 = 2_000;
/// A (chunk, owner) pair is re-subscribed to recover a ghost at most this often.
const RESYNC_EVERY_MS: u64 = 1_000;
/// Chunks whose nearby owners are cached at most: a few views' worth many times over (a view
/// of radius 5 is 121 chunks), a few megabytes at most.
pub(crate) const NEAR_CACHE_MAX: usize = 1 << 15;

/// What a ghost's new writer, where this node does not subscribe, means for the subscriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Follow {
    /// Not followed: no client here views the chunk (or the writer is this node).
    No,
    /// Followed already.
    Already,
    /// Followed from now on: the subscriptions are brought up to date at once.
    Started,
}

impl Follow {
    pub(crate) fn followed(self) -> bool {
        self != Follow::No
    }
}

/// What this node subscribes to and serves, and the ghosts that follow from it.
pub(crate) struct Replication {
    /// The (chunk, node) pairs of the interaction band, its keep margin and the handoff reach
    /// inside the area, always subscribed, by chunk.
    band: HashMap<ChunkPos, NodeSet>,
    /// chunk -> the nodes that may own an entity there (cleared with each partition).
    near_cache: HashMap<ChunkPos, Vec<NodeId>>,
    /// (chunk, owner) pairs re-subscribed lately to recover a ghost (monotonic ms).
    resynced: HashMap<(ChunkPos, NodeId), u64>,
    subs: Subscriptions,
    /// Every pair is to be worked out again (the partition changed).
    subs_dirty: bool,
    /// Chunks whose pairs are to be worked out again (a pair followed anew).
    subs_touched: HashSet<ChunkPos>,
    subscribers: Subscribers,
    sim: SimGhosts,
    /// Local entities that went in full to nodes not holding them, since the tick began. The
    /// accounts those nodes serve get the entity's current non-public state.
    newly_held: BTreeMap<u64, BTreeSet<NodeId>>,
    /// Render ghosts whose owner's link went down, and since when (monotonic ms): kept, still,
    /// until a frame refreshes them.
    stale: BTreeMap<u64, u64>,
    /// (chunk, node) pairs subscribed because a ghost in a viewed chunk went to a node the
    /// partition as known here does not put there (a newer partition not read yet, or an entity
    /// its owner could not hand over yet): kept while the chunk is viewed.
    followed: BTreeSet<(ChunkPos, NodeId)>,
}

impl Replication {
    pub fn new(cfg: &SidecarConfig, partition: &Partition) -> Self {
        let rules = GhostRules {
            band: i64::from(cfg.interaction_band_chunks),
            keep_margin: i64::from(cfg.ghost_keep_margin_chunks),
            min_lifespan_ms: cfg.ghost_min_lifespan_ms,
        };
        Self {
            band: band_of(cfg, partition),
            near_cache: HashMap::default(),
            resynced: HashMap::default(),
            subs: Subscriptions::default(),
            subs_dirty: true,
            subs_touched: HashSet::default(),
            subscribers: Subscribers::default(),
            sim: SimGhosts::new(rules),
            newly_held: BTreeMap::new(),
            stale: BTreeMap::new(),
            followed: BTreeSet::new(),
        }
    }

    // ------------------------------------------------------------------ what others read

    /// Whether this node subscribes to `chunk` at `owner`.
    pub(crate) fn subscribes(&self, chunk: ChunkPos, owner: NodeId) -> bool {
        self.subs.has(chunk, owner)
    }

    /// Whether `id` is a render ghost whose owner's link went down, not refreshed since.
    pub(crate) fn is_stale(&self, id: u64) -> bool {
        self.stale.contains_key(&id)
    }

    /// The stale render ghosts, by id.
    pub(crate) fn stale_ids(&self) -> Vec<u64> {
        self.stale.keys().copied().collect()
    }

    /// `id` went stale at `now_ms`, unless it already was.
    pub(crate) fn mark_stale(&mut self, id: u64, now_ms: u64) {
        self.stale.entry(id).or_insert(now_ms);
    }

    /// A stale ghost waits for its new writer from `now_ms` on.
    pub(crate) fn restart_stale(&mut self, id: u64, now_ms: u64) {
        if let Some(since) = self.stale.get_mut(&id) {
            *since = now_ms;
        }
    }

    /// `id` is no longer a stale ghost (refreshed, or dropped).
    pub(crate) fn forget_stale(&mut self, id: u64) {
        self.stale.remove(&id);
    }

    /// Local entities that went in full to nodes not holding them since the tick began.
    pub(crate) fn take_newly_held(&mut self) -> BTreeMap<u64, BTreeSet<NodeId>> {
        std::mem::take(&mut self.newly_held)
    }

    /// A local entity handed away: the nodes that held its render ghost.
    pub(crate) fn handed_away(&mut self, table: &mut EntityTable, id: u64) -> BTreeSet<NodeId> {
        self.newly_held.remove(&id);
        table.take_holders(id).iter().collect()
    }

    /// Whether `node` holds the render ghost of local entity `id`, as far as this node knows.
    pub(crate) fn holds_ghost(&self, table: &EntityTable, id: u64, node: NodeId) -> bool {
        table.holders(id).contains(&node)
    }

    /// Local entity `id` came back here: `holders` hold its render ghost (the old owner's
    /// replicas are this node's now).
    pub(crate) fn add_holders(
        &mut self,
        table: &mut EntityTable,
        id: u64,
        holders: impl Iterator<Item = NodeId>,
    ) {
        for node in holders {
            table.add_holder(id, node);
        }
    }

    /// Forgets the simulation ghost `id` (its game is adopting it): whether the game held it.
    pub(crate) fn forget_sim_ghost(&mut self, id: u64) -> bool {
        self.sim.forget(id)
    }

    /// The game went away, and the simulation ghosts it held with it.
    pub(crate) fn clear_sim_ghosts(&mut self) {
        self.sim.clear();
    }

    /// The (chunk, node) pairs this node serves.
    pub(crate) fn subscriber_count(&self) -> usize {
        self.subscribers.len()
    }

    /// The (chunk, owner) pairs this node subscribes to.
    pub(crate) fn subscription_count(&self) -> usize {
        self.subs.len()
    }

    /// The simulation ghosts the game holds.
    pub(crate) fn sim_ghost_count(&self) -> usize {
        self.sim.len()
    }

    /// Chunks whose nearby owners are cached.
    #[cfg(test)]
    pub(crate) fn near_cache_len(&self) -> usize {
        self.near_cache.len()
    }

    // ------------------------------------------------------------------ the partition

    /// A newer partition: its band is subscribed, and the owners near each chunk asked afresh.
    pub(crate) fn partition_changed(&mut self, cfg: &SidecarConfig, partition: &Partition) {
        self.band = band_of(cfg, partition);
        self.partitions_settled();
    }

    /// The previous partitions are forgotten: the owners near each chunk are asked afresh.
    pub(crate) fn partitions_settled(&mut self) {
        self.near_cache.clear();
        self.subs_dirty = true;
    }

    /// Every pair wanted, worked out whole: the band, the viewed chunks and the followed writers.
    fn wanted_whole(
        &mut self,
        cx: &Context,
        clients: &Clients,
        authority: &Authority,
    ) -> Vec<(ChunkPos, NodeId)> {
        let mut wanted: Vec<(ChunkPos, NodeId)> = self
            .band
            .iter()
            .flat_map(|(c, nodes)| nodes.iter().map(|n| (*c, n)))
            .collect();
        for c in clients.viewed_chunks() {
            wanted.extend(self.viewed_pairs(cx, authority, c).iter().map(|n| (c, n)));
        }
        wanted.extend(self.followed.iter().copied());
        wanted
    }

    /// What the pairs kept up to date chunk by chunk must equal: the whole (checked in debug
    /// builds, so every test run checks it).
    #[cfg(debug_assertions)]
    fn assert_subscriptions_whole(
        &mut self,
        cx: &Context,
        clients: &Clients,
        authority: &Authority,
    ) {
        let wanted: BTreeSet<(ChunkPos, NodeId)> = self
            .wanted_whole(cx, clients, authority)
            .into_iter()
            .collect();
        let held: BTreeSet<(ChunkPos, NodeId)> = self.subs.pairs().collect();
        assert_eq!(
            held, wanted,
            "subscriptions kept by chunk differ from the whole"
        );
    }

    /// The nodes a viewed `chunk` is subscribed at: those that may own an entity there, this
    /// node aside.
    fn viewed_pairs(&mut self, cx: &Context, authority: &Authority, chunk: ChunkPos) -> NodeSet {
        let me = cx.config.node_id;
        let near = self.owners_near(cx, authority, chunk);
        near.into_iter().filter(|n| *n != me).collect()
    }

    /// The nodes that may own an entity in `chunk`, cached per partition (at most
    /// [`NEAR_CACHE_MAX`] chunks).
    pub(crate) fn owners_near(
        &mut self,
        cx: &Context,
        authority: &Authority,
        chunk: ChunkPos,
    ) -> Vec<NodeId> {
        if let Some(v) = self.near_cache.get(&chunk) {
            return v.clone();
        }
        let reach = cx.config.reach_chunks();
        let mut near = subs::owners_near(authority.partition(), chunk, reach);
        for prev in authority.previous_partitions() {
            // Until the mass handoffs settle, the previous owners still write entities there.
            near.extend(subs::owners_near(prev, chunk, reach));
        }
        let v: Vec<NodeId> = near.into_iter().collect();
        if self.near_cache.len() >= NEAR_CACHE_MAX {
            // Roaming views would otherwise fill it with every chunk they ever held (the world
            // has millions); it refills with the chunks in use.
            self.near_cache.clear();
        }
        self.near_cache.insert(chunk, v.clone());
        v
    }

    // ------------------------------------------------------------------ owner: subscriptions

    /// The link to `node` is gone: what it subscribed to here is forgotten.
    pub(crate) fn peer_down(&mut self, cx: &Context, table: &mut EntityTable, node: NodeId) {
        self.subscribers.remove_node(node);
        cx.metrics.subscribers.set(self.subscribers.len() as i64);
        table.forget_holder(node);
    }

    pub(crate) fn on_subscribe(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        mesh: &Mesh,
        node: NodeId,
        chunks: Vec<mesh::ChunkRef>,
    ) {
        for c in chunks {
            let chunk = cx.config.world.normalise_chunk(ChunkPos { x: c.x, y: c.y });
            // Any chunk is served: a subscriber may run a newer partition than this node (or an
            // older one), or follow an entity this node could not hand over yet. Refusing would
            // leave it waiting for frames that never come.
            if !self.subscribers.add(node, chunk) {
                continue;
            }
            // The snapshot burst: every resident the node does not hold yet.
            let residents: Vec<u64> = table.residents(chunk).collect();
            for id in residents {
                if table.get_local(id).is_none() {
                    continue;
                }
                if table.add_holder(id, node) {
                    let state = full_state(table.get_local(id).expect("checked above"));
                    cx.metrics.cross_node_updates.inc();
                    mesh.send(cx, node, mesh_message::Body::EntityState(state));
                    self.newly_held.entry(id).or_default().insert(node);
                }
            }
        }
    }

    pub(crate) fn on_unsubscribe(
        &mut self,
        cx: &Context,
        table: &mut EntityTable,
        node: NodeId,
        chunks: Vec<mesh::ChunkRef>,
    ) {
        for c in chunks {
            let chunk = cx.config.world.normalise_chunk(ChunkPos { x: c.x, y: c.y });
            if !self.subscribers.remove(node, chunk) {
                continue;
            }
            // The node drops its ghosts there itself; only the bookkeeping changes here.
            let residents: Vec<u64> = table.residents(chunk).collect();
            for id in residents {
                table.remove_holder(id, node);
            }
        }
        cx.metrics.subscribers.set(self.subscribers.len() as i64);
    }

    /// Sends this tick's public changes of local entities once per subscribed node: a full
    /// state to a node that does not hold the entity yet, a delta to one that does, and a gone
    /// to one whose subscriptions it left.
    pub(crate) fn replicate(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        mesh: &Mesh,
        changes: &TickChanges,
    ) {
        for (&id, ch) in changes {
            if table.get_local(id).is_none() {
                // Despawned (a ghost never has replicas).
                let nodes = table.take_holders(id);
                {
                    for node in nodes.iter() {
                        cx.metrics.cross_node_updates.inc();
                        // Despawned: whatever epoch the holder knows, it is gone (0: unfenced).
                        mesh.send(
                            cx,
                            node,
                            mesh_message::Body::EntityGone(mesh::EntityGone {
                                entity_id: id,
                                entity_epoch: 0,
                                position: None,
                            }),
                        );
                    }
                }
                continue;
            }
            let held = table.take_holders(id);
            let e = table.get_local(id).expect("checked above");
            let target: BTreeSet<NodeId> = self.subscribers.of(e.chunk).collect();
            if target.is_empty() && held.is_empty() {
                continue;
            }
            let mut frames: Vec<(NodeId, mesh_message::Body)> = Vec::new();
            let full =
                (ch.spawned || target.iter().any(|n| !held.contains(n))).then(|| full_state(e));
            let delta = if ch.spawned {
                None
            } else {
                public_delta(e, ch)
            };
            for node in held.iter().filter(|n| !target.contains(n)) {
                frames.push((
                    node,
                    mesh_message::Body::EntityGone(mesh::EntityGone {
                        entity_id: id,
                        entity_epoch: e.epoch,
                        position: Some(vec3(e.position)),
                    }),
                ));
            }
            for &node in &target {
                if ch.spawned || !held.contains(&node) {
                    // Internal: `full` is built on this very condition, from the local table.
                    let state = full.clone().expect("built when some node needs it");
                    frames.push((node, mesh_message::Body::EntityState(state)));
                    self.newly_held.entry(id).or_default().insert(node);
                } else if let Some(d) = &delta {
                    frames.push((node, mesh_message::Body::EntityState(d.clone())));
                }
            }
            if !target.is_empty() {
                table.set_holders(id, target.iter().copied().collect());
            }
            for (node, body) in frames {
                cx.metrics.cross_node_updates.inc();
                mesh.send(cx, node, body);
            }
        }
    }

    /// Local entity `id` is written here again under an epoch its holders may have left (its
    /// unit came back from a target that died, whose frames they followed): every node
    /// subscribed to its chunk gets its whole state now, and one that held it but no longer
    /// subscribes there, its gone.
    pub(crate) fn announce(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        mesh: &Mesh,
        id: u64,
    ) {
        if table.get_local(id).is_none() {
            return;
        }
        // As if spawned this tick: whole to every subscriber, gone to the other holders.
        let whole = EntityChange {
            spawned: true,
            ..Default::default()
        };
        self.replicate(cx, table, mesh, &TickChanges::from([(id, whole)]));
    }

    /// Public events of local entities go to every node holding their ghost.
    pub(crate) fn replicate_events(
        &self,
        cx: &mut Context,
        table: &EntityTable,
        mesh: &Mesh,
        events: &[TickEvent],
    ) {
        for ev in events {
            if !ev.audience.is_public() || table.get_local(ev.entity_id).is_none() {
                continue;
            }
            for node in table.holders(ev.entity_id).iter() {
                cx.metrics.cross_node_updates.inc();
                mesh.send(
                    cx,
                    node,
                    mesh_message::Body::EntityEvent(mesh::EntityEvent {
                        entity_id: ev.entity_id,
                        r#type: ev.r#type,
                        payload: ev.payload.clone(),
                    }),
                );
            }
        }
    }

    // ------------------------------------------------------------------ observer side

    /// A ghost in `chunk` is now written by `owner`, where this node does not subscribe: if a
    /// client here views the chunk, the ghost stays and the chunk is subscribed at `owner` (its
    /// snapshot burst refreshes the ghost). A pair followed anew wants the subscriptions
    /// brought up to date at once.
    pub(crate) fn follow(
        &mut self,
        cx: &Context,
        clients: &Clients,
        chunk: ChunkPos,
        owner: NodeId,
    ) -> Follow {
        if owner == cx.config.node_id || !clients.is_viewed(chunk) {
            return Follow::No;
        }
        if self.followed.insert((chunk, owner)) {
            self.subs_touched.insert(chunk);
            return Follow::Started;
        }
        Follow::Already
    }

    /// The stale ghosts nobody refreshed, to be dropped: their owner's link is back and its
    /// snapshot burst did not include them, or it stayed down longer than two node leases while
    /// no unreachable writer of theirs was live by membership (the owner is gone; whoever takes
    /// its area over sends them again). `awaiting_restore`: the stale ghosts of dead processes,
    /// which stay until their restored owner writes them. `is_live`: whether the store last
    /// said a node has a live process. Returns the render ghosts to despawn.
    pub(crate) fn sweep_stale(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        authority: &Authority,
        mesh: &Mesh,
        awaiting_restore: &BTreeSet<u64>,
        is_live: impl Fn(NodeId) -> bool,
    ) -> Vec<u64> {
        let now = cx.now.mono_ms;
        let me = cx.config.node_id;
        let stale: Vec<(u64, u64)> = self.stale.iter().map(|(k, v)| (*k, *v)).collect();
        let mut gone = Vec::new();
        for (id, since) in stale {
            if awaiting_restore.contains(&id) {
                continue;
            }
            let Some((origin, chunk)) = table.get(id).and_then(|e| Some((e.origin()?, e.chunk)))
            else {
                gone.push((id, false));
                continue;
            };
            // Whoever may write it now must have been reachable for a while to have refreshed
            // it: while one of them is not, the ghost stays, up to two node leases (a writer
            // that died is noticed a lease and a membership poll after it did, and from then
            // on its ghosts wait for their restore).
            let mut writers = self.owners_near(cx, authority, chunk);
            writers.push(origin);
            writers.retain(|n| *n != me);
            let reachable_since = writers
                .iter()
                .map(|n| mesh.up_since_ms(*n))
                .try_fold(since, |acc, up| up.map(|t| acc.max(t)));
            // A writer cut off but still live by membership may still write the entity: its
            // ghost stays until the link is back and the snapshot burst says.
            let live_unreachable = || {
                writers
                    .iter()
                    .any(|n| mesh.up_since_ms(*n).is_none() && is_live(*n))
            };
            let expired = match reachable_since {
                Some(t) => now >= t + STALE_RESYNC_GRACE_MS,
                None => now >= since + 2 * cx.config.node_lease_ms && !live_unreachable(),
            };
            if expired {
                gone.push((id, true));
            }
        }
        let mut dropped = Vec::new();
        for (id, ghost) in gone {
            self.stale.remove(&id);
            if ghost {
                tracing::debug!(entity = id, "stale ghost dropped: not refreshed");
                dropped.push(id);
            }
        }
        dropped
    }

    /// A peer's `EntityState` the fence let through. Returns the render ghost it dropped, if
    /// any (it moved out of the chunks subscribed at its owner).
    pub(crate) fn on_entity_state(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        mesh: &Mesh,
        node: NodeId,
        s: mesh::EntityState,
    ) -> Option<u64> {
        // A frame of its owner: the ghost is current again.
        self.stale.remove(&s.entity_id);
        let existing = table.get(s.entity_id).map(|e| (e.origin(), e.chunk));
        if matches!(existing, Some((None, _))) {
            cx.metrics.drop_msg("ghost_of_local_entity", 1);
            return None;
        }
        let at = s.position.as_ref().map(position);
        let chunk = at
            .map(|p| cx.config.world.chunk_of(Pos { x: p.x, y: p.y }))
            .or(existing.map(|e| e.1));
        // Only what lies in a chunk this node subscribes to from that owner.
        if chunk.is_none_or(|c| !self.subs.has(c, node)) {
            if existing.is_some_and(|e| e.0 == Some(node)) {
                tracing::debug!(
                    me = cx.config.node_id,
                    entity = s.entity_id,
                    node,
                    ?chunk,
                    "ghost dropped: moved out of the subscribed chunks"
                );
                return Some(s.entity_id);
            }
            return None;
        }
        if s.full {
            let ghost = NewEntity {
                id: s.entity_id,
                position: at.unwrap_or_default(),
                owner_account: s.owner_account,
                is_master: s.is_master,
                parent_id: s.parent_id,
                components: public_components(s.components),
                origin: Some(node),
                epoch: s.entity_epoch,
            };
            if let Err(e) = table.set_ghost(ghost) {
                cx.metrics.drop_msg("bad_entity_state", 1);
                tracing::debug!(peer = node, error = %e, "entity state refused");
            }
        } else if existing.is_some_and(|e| e.0 == Some(node)) {
            let update = EntityUpdate {
                id: s.entity_id,
                position: at,
                changed: public_components(s.components),
                removed: s.removed_types,
            };
            if table.update(update).is_err() {
                cx.metrics.drop_msg("bad_entity_state", 1);
            }
        } else {
            // A delta for an entity this node never got the full state of: the owner thinks it
            // is held here. Subscribing to the chunk afresh gets a full snapshot burst.
            cx.metrics.drop_msg("ghost_unknown", 1);
            if let Some(c) = chunk {
                self.resync(cx, mesh, c, node);
            }
        }
        None
    }

    /// Asks `owner` for a fresh snapshot of `chunk` (at most once a second per pair).
    pub(crate) fn resync(&mut self, cx: &mut Context, mesh: &Mesh, chunk: ChunkPos, owner: NodeId) {
        let now = cx.now.mono_ms;
        if self
            .resynced
            .get(&(chunk, owner))
            .is_some_and(|t| now < t + RESYNC_EVERY_MS)
        {
            return;
        }
        self.resynced.retain(|_, t| now < *t + RESYNC_EVERY_MS);
        self.resynced.insert((chunk, owner), now);
        let refs = chunk_refs(&[chunk]);
        mesh.send(
            cx,
            owner,
            mesh_message::Body::Unsubscribe(mesh::Unsubscribe {
                chunks: refs.clone(),
            }),
        );
        mesh.send(
            cx,
            owner,
            mesh_message::Body::Subscribe(mesh::Subscribe { chunks: refs }),
        );
    }

    /// The link to `owner` is back: what this node subscribes to there is asked again (the
    /// owner forgot it with the last link), for a fresh snapshot burst.
    pub(crate) fn resubscribe(&self, cx: &mut Context, mesh: &Mesh, owner: NodeId) {
        let held = self.subs.of_owner(owner);
        for part in held.chunks(CHUNKS_PER_MESSAGE) {
            mesh.send(
                cx,
                owner,
                mesh_message::Body::Subscribe(mesh::Subscribe {
                    chunks: chunk_refs(part),
                }),
            );
        }
    }

    /// Brings the subscriptions to what the clients' views and the interaction band need, in
    /// one batch per owner: every pair after a partition change, else only the pairs of the
    /// chunks that came into views or left them (`flipped`) or gained a followed writer.
    /// Returns the render ghosts in chunks let go of, to despawn.
    pub(crate) fn update_subscriptions(
        &mut self,
        cx: &mut Context,
        flipped: HashSet<ChunkPos>,
        clients: &Clients,
        authority: &Authority,
        table: &EntityTable,
        mesh: &Mesh,
    ) -> Vec<u64> {
        self.subs_touched.extend(flipped);
        if !self.subs_dirty && self.subs_touched.is_empty() {
            return Vec::new();
        }
        // A followed writer is kept while its chunk is viewed: one that is not any more flipped.
        self.followed.retain(|(c, _)| clients.is_viewed(*c));
        let touched = std::mem::take(&mut self.subs_touched);
        let changes = if std::mem::take(&mut self.subs_dirty) {
            let wanted = self.wanted_whole(cx, clients, authority);
            self.subs.update(wanted)
        } else {
            let wanted: Vec<(ChunkPos, NodeSet)> = touched
                .into_iter()
                .map(|c| {
                    let mut nodes = self.band.get(&c).cloned().unwrap_or_default();
                    if clients.is_viewed(c) {
                        nodes.extend(self.viewed_pairs(cx, authority, c).iter());
                    }
                    let followed = self.followed.range((c, NodeId::MIN)..=(c, NodeId::MAX));
                    nodes.extend(followed.map(|(_, n)| *n));
                    (c, nodes)
                })
                .collect();
            let changes = self.subs.update_chunks(wanted);
            #[cfg(debug_assertions)]
            self.assert_subscriptions_whole(cx, clients, authority);
            changes
        };
        let mut dropped = Vec::new();
        for (owner, chunks) in changes.unsubscribe {
            for c in &chunks {
                let ghosts = table
                    .residents(*c)
                    .filter(|id| table.get(*id).is_some_and(|e| e.origin() == Some(owner)));
                for id in ghosts {
                    tracing::debug!(
                        me = cx.config.node_id,
                        entity = id,
                        owner,
                        "ghost dropped: chunk unsubscribed"
                    );
                    dropped.push(id);
                }
            }
            for part in chunks.chunks(CHUNKS_PER_MESSAGE) {
                mesh.send(
                    cx,
                    owner,
                    mesh_message::Body::Unsubscribe(mesh::Unsubscribe {
                        chunks: chunk_refs(part),
                    }),
                );
            }
        }
        for (owner, chunks) in changes.subscribe {
            for part in chunks.chunks(CHUNKS_PER_MESSAGE) {
                mesh.send(
                    cx,
                    owner,
                    mesh_message::Body::Subscribe(mesh::Subscribe {
                        chunks: chunk_refs(part),
                    }),
                );
            }
        }
        cx.metrics.subscriptions.set(self.subs.len() as i64);
        dropped
    }

    /// Pushes the render ghosts in the interaction band to the game as simulation ghosts, with
    /// hysteresis and a minimum lifespan. `game_connected`: whether a game is there to hold
    /// them; `adopting`: whether the game is adopting an entity (no longer a ghost to it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step_sim_ghosts(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        area: &[ChunkRect],
        game_connected: bool,
        adopting: impl Fn(u64) -> bool,
        changes: &TickChanges,
        now_ms: u64,
    ) {
        if !game_connected {
            self.sim.clear();
            return;
        }
        let mut ids: BTreeSet<u64> = self.sim.ids().into_iter().collect();
        for (&id, _) in changes.iter() {
            if table.get(id).is_none_or(|e| e.origin().is_some()) {
                ids.insert(id);
            }
        }
        let world = cx.config.world;
        for id in ids {
            if adopting(id) {
                // Its game is adopting it: no longer a ghost to it.
                continue;
            }
            let ghost = table.get(id).filter(|e| e.origin().is_some());
            let distance = ghost.map(|e| distance_to_area(&world, area, e.chunk));
            let ch = changes.get(&id);
            let step = self.sim.observe(now_ms, id, distance, ch.is_some());
            let msg = match (step, ghost) {
                (GhostStep::Enter, Some(e)) => {
                    sidecar_message::Body::GhostEnter(local::GhostEnter {
                        entity_id: id,
                        position: Some(to_local_vec3(e.position)),
                        components: e
                            .components
                            .iter()
                            .map(|(t, c)| local_component(*t, &c.payload))
                            .collect(),
                    })
                }
                (GhostStep::Update, Some(e)) => {
                    let ch = ch.cloned().unwrap_or_default();
                    let (changed, removed) = if ch.spawned {
                        (e.components.keys().copied().collect::<Vec<_>>(), vec![])
                    } else {
                        ch.components
                            .keys()
                            .partition(|t| e.components.contains_key(t))
                    };
                    sidecar_message::Body::GhostUpdate(local::GhostUpdate {
                        entity_id: id,
                        position: (ch.moved || ch.spawned).then_some(to_local_vec3(e.position)),
                        changed: changed
                            .iter()
                            .filter_map(|t| {
                                e.components.get(t).map(|c| local_component(*t, &c.payload))
                            })
                            .collect(),
                        removed_types: removed,
                    })
                }
                (GhostStep::Leave, _) => {
                    sidecar_message::Body::GhostLeave(local::GhostLeave { entity_id: id })
                }
                _ => continue,
            };
            cx.out.to_game.push(msg.into());
        }
        cx.metrics.ghosts_sim.set(self.sim.len() as i64);
    }
}

/// The (chunk, node) pairs always subscribed under `partition`: the interaction band, its keep
/// margin and the handoff reach inside the area.
fn band_of(cfg: &SidecarConfig, partition: &Partition) -> HashMap<ChunkPos, NodeSet> {
    let keep = i64::from(cfg.interaction_band_chunks + cfg.ghost_keep_margin_chunks);
    let mut by_chunk: HashMap<ChunkPos, NodeSet> = HashMap::default();
    for (c, n) in subs::band(partition, cfg.node_id, keep, cfg.reach_chunks()) {
        by_chunk.entry(c).or_default().insert(n);
    }
    by_chunk
}
