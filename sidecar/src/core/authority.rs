//! The node's own lot: its lease, the partition it serves under, and draining.

use std::collections::BTreeSet;
use std::sync::Arc;

use cellmesh_geo_router::geometry::ChunkRect;
use cellmesh_geo_router::partition::{NodeId, Partition};
use cellmesh_geo_router::world_map::NodeMap;
use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};

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
    /// False once the node lease was lost: everything is frozen, nothing is written.
    pub lease_live: bool,
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
            lease_until_ms: None,
            draining: None,
        }
    }
}

/// The previous partition is forgotten no sooner than this after a change.
const SETTLE_MIN_MS: u64 = 1_000;

/// Chunks whose nearby owners are cached at most: a few views' worth many times over (a view
/// of radius 5 is 121 chunks), a few megabytes at most.
pub(crate) const NEAR_CACHE_MAX: usize = 1 << 15;

impl Core {
    // ------------------------------------------------------------------ the node's own lot

    /// A renewal landed: minting and writing go on until its terms.
    pub(crate) fn on_lease_renewed(&mut self, terms: LeaseTerms) {
        if !self.auth.lease_live {
            // Lost is lost: the world may already have moved on without this node.
            return;
        }
        self.auth.lease_until_ms = Some(
            self.auth
                .lease_until_ms
                .map_or(terms.until_ms, |u| u.max(terms.until_ms)),
        );
        // A lease of another node id would be a driver bug; minting then stays bounded.
        let _ = self.game.ids.renewed(&terms.lease);
    }

    /// No renewal landed before the lease's deadline: stop writing now, before the store could
    /// grant the id to anyone else.
    pub(crate) fn check_lease_deadline(&mut self) {
        if self.auth.lease_live
            && self
                .auth
                .lease_until_ms
                .is_some_and(|u| self.now.mono_ms >= u)
        {
            tracing::error!("no renewal of the node lease landed before its deadline");
            self.on_lease_lost();
        }
    }

    /// Whether this process may still write at `mono_ms` of its own clock: its lease is neither
    /// lost nor past its deadline. (The simulator checks it whenever the store grants this
    /// node's id to another process.)
    pub fn writes_at(&self, mono_ms: u64) -> bool {
        self.auth.lease_live && self.auth.lease_until_ms.is_none_or(|u| mono_ms < u)
    }

    /// The lease was lost: this process writes nothing ever again and should exit, so that its
    /// supervisor starts it afresh.
    pub fn lease_lost(&self) -> bool {
        !self.auth.lease_live
    }

    /// Another process holds this node's id: everything is frozen rather than written twice.
    pub(crate) fn on_lease_lost(&mut self) {
        self.metrics.error("lease_lost");
        self.set_ready(false);
        if !self.auth.lease_live {
            return;
        }
        self.auth.lease_live = false;
        let owned: Vec<(u64, u64)> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none())
            .map(|e| (e.id, e.epoch))
            .collect();
        tracing::error!(
            entities = owned.len(),
            "the node lease was lost: freezing everything this node owns, then exiting"
        );
        self.out.exit = Some(
            "the node lease was lost: another process may hold this node id now; everything \
             this process wrote is frozen and restored elsewhere from its checkpoints"
                .into(),
        );
        for (id, epoch) in owned {
            self.out.to_game.push(
                sidecar_message::Body::Freeze(local::Freeze {
                    entity_id: id,
                    entity_epoch: epoch,
                })
                .into(),
            );
        }
    }

    /// A newer partition: the game learns its area, peers learn this node applied it, and every
    /// entity standing where the partition gave the area to another node is handed over.
    pub(crate) fn apply_partition(&mut self, p: Partition) {
        if p.epoch() <= self.auth.partition.epoch() {
            return;
        }
        let me = self.cfg.node_id;
        tracing::info!(epoch = p.epoch(), "applying a new partition");
        self.auth.area = subs::merge_rects(p.area_of(me));
        let keep = i64::from(self.cfg.interaction_band_chunks + self.cfg.ghost_keep_margin_chunks);
        self.repl.band = subs::band(&p, me, keep, self.cfg.reach_chunks());
        // Retired: the director deleted this node's cell (it held nothing by then).
        let retired = !p.members().contains(&me) && self.auth.partition.members().contains(&me);
        let prev = std::mem::replace(&mut self.auth.partition, std::sync::Arc::new(p));
        self.auth.prev_partitions.push(prev);
        self.auth.changed_at_ms = self.now.mono_ms;
        self.repl.near_cache.clear();
        self.repl.subs_dirty = true;
        let owned_area = self.owned_rects();
        if self.game.slot.is_some() {
            self.out.to_game.push(
                sidecar_message::Body::PartitionChanged(local::PartitionChanged {
                    partition_epoch: self.auth.partition.epoch(),
                    owned_area,
                })
                .into(),
            );
        }
        let ack = mesh_message::Body::PartitionAck(mesh::PartitionAck {
            partition_epoch: self.auth.partition.epoch(),
        });
        self.broadcast(ack);
        let gone: BTreeSet<u64> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none() && self.auth.partition.owner_of_chunk(e.chunk) != me)
            .map(|e| e.id)
            .collect();
        self.handoff.mass.extend(gone.iter().copied());
        self.handoff.recheck.extend(gone);
        self.spawners_replanned();
        if retired {
            match self.cfg.when_retired {
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
        if self.auth.draining.is_some() {
            return;
        }
        tracing::info!(
            "draining: refusing handoffs; waiting for the partition to give this node's area away"
        );
        self.set_ready(false);
        self.auth.draining = Some(self.now.mono_ms + self.cfg.drain_timeout_ms);
    }

    /// Whether a drain is over: nothing left that another node could take (no real here and no
    /// handoff in flight; a lone node or one without a game has nothing to hand), or out of time.
    pub(crate) fn drained(&self) -> bool {
        let Some(deadline) = self.auth.draining else {
            return false;
        };
        let reals = self.table.len() - self.table.ghost_count();
        if self.game.slot.is_none() || !self.mesh.clustered {
            return true;
        }
        if reals == 0 && self.handoff.out.in_flight() == 0 {
            return true;
        }
        if self.now.mono_ms >= deadline {
            tracing::warn!(left = reals, "drain timed out with entities still here");
            return true;
        }
        false
    }

    /// The nodes that may own an entity in `chunk`, cached per partition (at most
    /// [`NEAR_CACHE_MAX`] chunks).
    pub(crate) fn owners_near(
        &mut self,
        chunk: cellmesh_geo_router::geometry::ChunkPos,
    ) -> Vec<NodeId> {
        if let Some(v) = self.repl.near_cache.get(&chunk) {
            return v.clone();
        }
        let reach = self.cfg.reach_chunks();
        let mut near = subs::owners_near(&self.auth.partition, chunk, reach);
        for prev in &self.auth.prev_partitions {
            // Until the mass handoffs settle, the previous owners still write entities there.
            near.extend(subs::owners_near(prev, chunk, reach));
        }
        let v: Vec<NodeId> = near.into_iter().collect();
        if self.repl.near_cache.len() >= NEAR_CACHE_MAX {
            // Roaming views would otherwise fill it with every chunk they ever held (the world
            // has millions); it refills with the chunks in use.
            self.repl.near_cache.clear();
        }
        self.repl.near_cache.insert(chunk, v.clone());
        v
    }

    /// Forgets the previous partitions once every peer says it runs the current one, every
    /// ghost here is written by a node the current partition puts near it (the mass handoffs
    /// settled), and at least a second after the last change.
    pub(crate) fn settle_partition(&mut self) {
        if self.auth.prev_partitions.is_empty()
            || self.now.mono_ms < self.auth.changed_at_ms + SETTLE_MIN_MS
        {
            return;
        }
        let epoch = self.auth.partition.epoch();
        let peers_caught_up = self.mesh.peers.iter().all(|(node, p)| {
            p.link.is_none() || self.mesh.peer_partition.get(node).copied().unwrap_or(0) >= epoch
        });
        let reach = self.cfg.reach_chunks();
        let settled = peers_caught_up
            && self.table.iter().all(|e| match e.origin {
                None => true,
                Some(n) => subs::owners_near(&self.auth.partition, e.chunk, reach).contains(&n),
            });
        if settled {
            self.auth.prev_partitions.clear();
            self.repl.near_cache.clear();
            self.repl.subs_dirty = true;
        }
    }

    /// This node's part of the live map: its reals (every k-th past `max`, by id) and its
    /// handoffs of the last second.
    pub fn node_map(&mut self, max: usize) -> NodeMap {
        use cellmesh_geo_router::world_map::{sample_evenly, EntityKind, MapEntity};
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
                node: self.cfg.node_id,
            })
            .collect();
        reals.sort_unstable_by_key(|e| e.id);
        NodeMap {
            node: self.cfg.node_id,
            geo: self.cfg.geo.clone(),
            partition_epoch: self.auth.partition.epoch(),
            entities_total: reals.len() as u64,
            entities: sample_evenly(reals, max),
            handoffs: self.handoff.recent.shown(self.now.mono_ms),
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
                frozen: self.handoff.out.is_frozen(e.id) || !self.auth.lease_live,
            })
            .collect();
        v.sort_unstable_by_key(|r| r.id);
        v
    }
}
