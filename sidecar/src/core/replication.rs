//! Replication: the chunk subscriptions this node holds and serves, the render ghosts it keeps,
//! and the simulation ghosts it pushes to its game (docs/mesh.md#interest-node-level-chunk-subscriptions, #ghosts).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::{ChunkPos, Pos};
use cellmesh_world::partition::{NodeId, Partition};

use super::wire::*;
use super::*;
use crate::config::SidecarConfig;
use crate::model::entities::{EntityUpdate, NewEntity, TickChanges};
use crate::model::fold::TickEvent;
use crate::model::ghosts::GhostStep;
use crate::model::ghosts::{GhostRules, SimGhosts};
use crate::model::subs::{self, distance_to_area, Subscribers, Subscriptions};

/// Chunks per subscribe message, so a large band fits a frame.
pub(crate) const CHUNKS_PER_MESSAGE: usize = 4096;
/// Once the owner's link is back, a stale ghost its snapshot burst did not refresh goes after
/// this long (the entity left, or went elsewhere).
const STALE_RESYNC_GRACE_MS: u64 = 2_000;
/// A (chunk, owner) pair is re-subscribed to recover a ghost at most this often.
const RESYNC_EVERY_MS: u64 = 1_000;

/// What this node subscribes to and serves, and the ghosts that follow from it.
pub(crate) struct Replication {
    /// The (chunk, node) pairs of the interaction band, its keep margin and the handoff reach
    /// inside the area, always subscribed.
    pub band: HashSet<(ChunkPos, NodeId)>,
    /// chunk -> the nodes that may own an entity there (cleared with each partition).
    pub near_cache: HashMap<ChunkPos, Vec<NodeId>>,
    /// (chunk, owner) pairs re-subscribed lately to recover a ghost (monotonic ms).
    pub resynced: HashMap<(ChunkPos, NodeId), u64>,
    pub subs: Subscriptions,
    pub subs_dirty: bool,
    pub subscribers: Subscribers,
    /// Local entity -> nodes holding its render ghost.
    pub replicas: HashMap<u64, BTreeSet<NodeId>>,
    pub sim: SimGhosts,
    /// Local entities that went in full to nodes not holding them, since the tick began. The
    /// accounts those nodes serve get the entity's current non-public state.
    pub newly_held: BTreeMap<u64, BTreeSet<NodeId>>,
    /// Render ghosts whose owner's link went down, and since when (monotonic ms): kept, still,
    /// until a frame refreshes them.
    pub stale: BTreeMap<u64, u64>,
    /// (chunk, node) pairs subscribed because a ghost in a viewed chunk went to a node the
    /// partition as known here does not put there (a newer partition not read yet, or an entity
    /// its owner could not hand over yet): kept while the chunk is viewed.
    pub followed: BTreeSet<(ChunkPos, NodeId)>,
}

impl Replication {
    pub fn new(cfg: &SidecarConfig, partition: &Partition) -> Self {
        let keep = i64::from(cfg.interaction_band_chunks + cfg.ghost_keep_margin_chunks);
        let rules = GhostRules {
            band: i64::from(cfg.interaction_band_chunks),
            keep_margin: i64::from(cfg.ghost_keep_margin_chunks),
            min_lifespan_ms: cfg.ghost_min_lifespan_ms,
        };
        Self {
            band: subs::band(partition, cfg.node_id, keep, cfg.reach_chunks()),
            near_cache: HashMap::default(),
            resynced: HashMap::default(),
            subs: Subscriptions::default(),
            subs_dirty: true,
            subscribers: Subscribers::default(),
            replicas: HashMap::default(),
            sim: SimGhosts::new(rules),
            newly_held: BTreeMap::new(),
            stale: BTreeMap::new(),
            followed: BTreeSet::new(),
        }
    }
}

impl Core {
    // ------------------------------------------------------------------ owner: subscriptions

    pub(crate) fn on_subscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        for c in chunks {
            let chunk = self
                .cx
                .config
                .world
                .normalise_chunk(ChunkPos { x: c.x, y: c.y });
            // Any chunk is served: a subscriber may run a newer partition than this node (or an
            // older one), or follow an entity this node could not hand over yet. Refusing would
            // leave it waiting for frames that never come.
            if !self.replication.subscribers.add(node, chunk) {
                continue;
            }
            // The snapshot burst: every resident the node does not hold yet.
            let residents: Vec<u64> = self.table.residents(chunk).collect();
            for id in residents {
                let Some(e) = self.table.get_local(id) else {
                    continue;
                };
                if self
                    .replication
                    .replicas
                    .entry(id)
                    .or_default()
                    .insert(node)
                {
                    let state = full_state(e);
                    self.cx.metrics.cross_node_updates.inc();
                    self.send_peer(node, mesh_message::Body::EntityState(state));
                    self.replication
                        .newly_held
                        .entry(id)
                        .or_default()
                        .insert(node);
                }
            }
        }
    }

    pub(crate) fn on_unsubscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        self.forget_subscriptions(node, chunks);
        self.cx
            .metrics
            .subscribers
            .set(self.replication.subscribers.len() as i64);
    }

    pub(crate) fn forget_subscriptions(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        for c in chunks {
            let chunk = self
                .cx
                .config
                .world
                .normalise_chunk(ChunkPos { x: c.x, y: c.y });
            if !self.replication.subscribers.remove(node, chunk) {
                continue;
            }
            // The node drops its ghosts there itself; only the bookkeeping changes here.
            let residents: Vec<u64> = self.table.residents(chunk).collect();
            for id in residents {
                if let Some(nodes) = self.replication.replicas.get_mut(&id) {
                    nodes.remove(&node);
                    if nodes.is_empty() {
                        self.replication.replicas.remove(&id);
                    }
                }
            }
        }
    }

    /// Sends this tick's public changes of local entities once per subscribed node: a full
    /// state to a node that does not hold the entity yet, a delta to one that does, and a gone
    /// to one whose subscriptions it left.
    pub(crate) fn replicate(&mut self, changes: &TickChanges) {
        for (&id, ch) in changes {
            let Some(e) = self.table.get_local(id) else {
                // Despawned (a ghost never has replicas).
                if let Some(nodes) = self.replication.replicas.remove(&id) {
                    for node in nodes {
                        self.cx.metrics.cross_node_updates.inc();
                        // Despawned: whatever epoch the holder knows, it is gone (0: unfenced).
                        self.send_peer(
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
            };
            let target: BTreeSet<NodeId> = self.replication.subscribers.of(e.chunk).collect();
            let held = self.replication.replicas.remove(&id).unwrap_or_default();
            if target.is_empty() && held.is_empty() {
                continue;
            }
            let mut frames: Vec<(NodeId, mesh_message::Body)> = Vec::new();
            let full = (!target.is_subset(&held) || ch.spawned).then(|| full_state(e));
            let delta = if ch.spawned {
                None
            } else {
                public_delta(e, ch)
            };
            for &node in held.difference(&target) {
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
                    self.replication
                        .newly_held
                        .entry(id)
                        .or_default()
                        .insert(node);
                } else if let Some(d) = &delta {
                    frames.push((node, mesh_message::Body::EntityState(d.clone())));
                }
            }
            if !target.is_empty() {
                self.replication.replicas.insert(id, target);
            }
            for (node, body) in frames {
                self.cx.metrics.cross_node_updates.inc();
                self.send_peer(node, body);
            }
        }
    }

    /// Public events of local entities go to every node holding their ghost.
    pub(crate) fn replicate_events(&mut self, events: &[TickEvent]) {
        for ev in events {
            if !ev.audience.is_public() || self.table.get_local(ev.entity_id).is_none() {
                continue;
            }
            let Some(nodes) = self.replication.replicas.get(&ev.entity_id).cloned() else {
                continue;
            };
            for node in nodes {
                self.cx.metrics.cross_node_updates.inc();
                self.send_peer(
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
    /// client here views the chunk, the ghost stays and the chunk is subscribed at `owner` at
    /// once (its snapshot burst refreshes the ghost). Returns whether it is followed.
    pub(crate) fn follow(&mut self, chunk: ChunkPos, owner: NodeId) -> bool {
        if owner == self.cx.config.node_id || !self.gateway.clients.is_viewed(chunk) {
            return false;
        }
        if self.replication.followed.insert((chunk, owner)) {
            self.replication.subs_dirty = true;
            self.update_subscriptions();
        }
        true
    }

    /// Drops the stale ghosts nobody refreshed: their owner's link is back and its snapshot
    /// burst did not include them, or it stayed down longer than a node lease (the owner is
    /// gone; whoever takes its area over sends them again).
    pub(crate) fn sweep_stale_ghosts(&mut self) {
        if self.replication.stale.is_empty() {
            return;
        }
        let now = self.cx.now.mono_ms;
        let me = self.cx.config.node_id;
        let stale: Vec<(u64, u64)> = self
            .replication
            .stale
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        let mut gone = Vec::new();
        for (id, since) in stale {
            if self.awaits_restore(id) {
                // A dead process's ghost stays until its restored owner writes it.
                continue;
            }
            let Some((origin, chunk)) = self.table.get(id).and_then(|e| Some((e.origin?, e.chunk)))
            else {
                gone.push((id, false));
                continue;
            };
            let link_up = |core: &Self, n: NodeId| core.mesh.up_since_ms(n);
            // Whoever may write it now must have been reachable for a while to have refreshed
            // it: while one of them is not, the ghost stays, up to two node leases (a writer
            // that died is noticed a lease and a membership poll after it did, and from then
            // on its ghosts wait for their restore).
            let mut writers = self.owners_near(chunk);
            writers.push(origin);
            let reachable_since = writers
                .into_iter()
                .filter(|n| *n != me)
                .map(|n| link_up(self, n))
                .try_fold(since, |acc, up| up.map(|t| acc.max(t)));
            let expired = match reachable_since {
                Some(t) => now >= t + STALE_RESYNC_GRACE_MS,
                None => now >= since + 2 * self.cx.config.node_lease_ms,
            };
            if expired {
                gone.push((id, true));
            }
        }
        for (id, ghost) in gone {
            self.replication.stale.remove(&id);
            if ghost {
                tracing::debug!(entity = id, "stale ghost dropped: not refreshed");
                let _ = self.table.despawn(id);
                self.handoff.fence.forget(id);
            }
        }
    }

    pub(crate) fn on_entity_state(&mut self, node: NodeId, s: mesh::EntityState) {
        // A frame of its owner: the ghost is current again.
        self.replication.stale.remove(&s.entity_id);
        let existing = self.table.get(s.entity_id).map(|e| (e.origin, e.chunk));
        if matches!(existing, Some((None, _))) {
            return self.cx.metrics.drop_msg("ghost_of_local_entity", 1);
        }
        let at = s.position.as_ref().map(position);
        let chunk = at
            .map(|p| self.cx.config.world.chunk_of(Pos { x: p.x, y: p.y }))
            .or(existing.map(|e| e.1));
        // Only what lies in a chunk this node subscribes to from that owner.
        if chunk.is_none_or(|c| !self.replication.subs.has(c, node)) {
            if existing.is_some_and(|e| e.0 == Some(node)) {
                tracing::debug!(
                    me = self.cx.config.node_id,
                    entity = s.entity_id,
                    node,
                    ?chunk,
                    "ghost dropped: moved out of the subscribed chunks"
                );
                let _ = self.table.despawn(s.entity_id);
                self.handoff.fence.forget(s.entity_id);
            }
            return;
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
            if let Err(e) = self.table.set_ghost(ghost) {
                self.cx.metrics.drop_msg("bad_entity_state", 1);
                tracing::debug!(peer = node, error = %e, "entity state refused");
            }
        } else if existing.is_some_and(|e| e.0 == Some(node)) {
            let update = EntityUpdate {
                id: s.entity_id,
                position: at,
                changed: public_components(s.components),
                removed: s.removed_types,
            };
            if self.table.update(update).is_err() {
                self.cx.metrics.drop_msg("bad_entity_state", 1);
            }
        } else {
            // A delta for an entity this node never got the full state of: the owner thinks it
            // is held here. Subscribing to the chunk afresh gets a full snapshot burst.
            self.cx.metrics.drop_msg("ghost_unknown", 1);
            if let Some(c) = chunk {
                self.resync(c, node);
            }
        }
    }

    /// Asks `owner` for a fresh snapshot of `chunk` (at most once a second per pair).
    pub(crate) fn resync(&mut self, chunk: ChunkPos, owner: NodeId) {
        let now = self.cx.now.mono_ms;
        if self
            .replication
            .resynced
            .get(&(chunk, owner))
            .is_some_and(|t| now < t + RESYNC_EVERY_MS)
        {
            return;
        }
        self.replication
            .resynced
            .retain(|_, t| now < *t + RESYNC_EVERY_MS);
        self.replication.resynced.insert((chunk, owner), now);
        let refs = chunk_refs(&[chunk]);
        self.send_peer(
            owner,
            mesh_message::Body::Unsubscribe(mesh::Unsubscribe {
                chunks: refs.clone(),
            }),
        );
        self.send_peer(
            owner,
            mesh_message::Body::Subscribe(mesh::Subscribe { chunks: refs }),
        );
    }

    /// Brings the subscriptions to what the clients' views and the interaction band need, in
    /// one batch per owner; ghosts in chunks let go of vanish.
    pub(crate) fn update_subscriptions(&mut self) {
        if !(self.gateway.clients.take_views_changed() || self.replication.subs_dirty) {
            return;
        }
        self.replication.subs_dirty = false;
        let me = self.cx.config.node_id;
        let mut wanted = self.replication.band.clone();
        let viewed: Vec<ChunkPos> = self.gateway.clients.viewed_chunks().collect();
        for c in viewed {
            for n in self.owners_near(c) {
                if n != me {
                    wanted.insert((c, n));
                }
            }
        }
        let clients = &self.gateway.clients;
        self.replication
            .followed
            .retain(|(c, _)| clients.is_viewed(*c));
        wanted.extend(self.replication.followed.iter().copied());
        let changes = self.replication.subs.update(wanted);
        for (owner, chunks) in changes.unsubscribe {
            for c in &chunks {
                let ghosts: Vec<u64> = self
                    .table
                    .residents(*c)
                    .filter(|id| self.table.get(*id).is_some_and(|e| e.origin == Some(owner)))
                    .collect();
                for id in ghosts {
                    tracing::debug!(me, entity = id, owner, "ghost dropped: chunk unsubscribed");
                    let _ = self.table.despawn(id);
                    self.handoff.fence.forget(id);
                }
            }
            for part in chunks.chunks(CHUNKS_PER_MESSAGE) {
                self.send_peer(
                    owner,
                    mesh_message::Body::Unsubscribe(mesh::Unsubscribe {
                        chunks: chunk_refs(part),
                    }),
                );
            }
        }
        for (owner, chunks) in changes.subscribe {
            for part in chunks.chunks(CHUNKS_PER_MESSAGE) {
                self.send_peer(
                    owner,
                    mesh_message::Body::Subscribe(mesh::Subscribe {
                        chunks: chunk_refs(part),
                    }),
                );
            }
        }
        self.cx
            .metrics
            .subscriptions
            .set(self.replication.subs.len() as i64);
    }

    /// Pushes the render ghosts in the interaction band to the game as simulation ghosts, with
    /// hysteresis and a minimum lifespan.
    pub(crate) fn step_sim_ghosts(&mut self, changes: &TickChanges, now_ms: u64) {
        if self.game.slot.is_none() {
            self.replication.sim.clear();
            return;
        }
        let mut ids: BTreeSet<u64> = self.replication.sim.ids().into_iter().collect();
        for (&id, _) in changes.iter() {
            if self.table.get(id).is_none_or(|e| e.origin.is_some()) {
                ids.insert(id);
            }
        }
        let world = self.cx.config.world;
        for id in ids {
            if self.handoff.adopting.contains_key(&id) {
                // Its game is adopting it: no longer a ghost to it.
                continue;
            }
            let ghost = self.table.get(id).filter(|e| e.origin.is_some());
            let distance = ghost.map(|e| distance_to_area(&world, &self.authority.area, e.chunk));
            let ch = changes.get(&id);
            let step = self
                .replication
                .sim
                .observe(now_ms, id, distance, ch.is_some());
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
            self.cx.out.to_game.push(msg.into());
        }
        self.cx
            .metrics
            .ghosts_sim
            .set(self.replication.sim.len() as i64);
    }
}
