//! The node's side of the peer protocol (DESIGN §7-§9): what it sends other sidecars and what
//! it does with what they send.
//!
//! - As an **owner**: answers chunk subscriptions with a snapshot burst, then sends each public
//!   change of its entities once per subscribed node (`replicate`); routes non-public components,
//!   events and messages to the gateways of the accounts they name (`route_tick`); tells remote
//!   gateways where their players' avatars are (`send_anchors`); hands forwarded input and
//!   remote joins to its game.
//! - As an **observer**: keeps the render ghosts of the chunks it subscribes to, and pushes the
//!   ones in its interaction band to its game as simulation ghosts.
//! - As a **gateway**: delivers routed pieces to its sessions after checking their epoch.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cellmesh_geo_router::geometry::{ChunkPos, Pos};
use cellmesh_geo_router::partition::NodeId;
use cellmesh_geo_router::store::SessionEntry;
use cellmesh_proto::batch::{encode_delta, encode_event, encode_message, Encoded};
use cellmesh_proto::edge::{AccountMessage, ComponentData, DeltaKind, EntityDelta, EventData};
use cellmesh_proto::local::{self, sidecar_message, AudienceKind};
use cellmesh_proto::mesh::{self, mesh_message, PieceKind};
use tokio_util::sync::CancellationToken;

use crate::audience::Audience;
use crate::cluster::{self, PeerInfo};
use crate::entities::{
    Component, Entity, EntityChange, EntityUpdate, NewEntity, Position, TickChanges,
};
use crate::fold::{Part, TickEvent, TickSend};
use crate::ghosts::GhostStep;
use crate::node::{LinkId, Node, NodeEvent, STORE_TIMEOUT};
use crate::route::{self, Addressed, Target};
use crate::subs::distance_to_area;

/// Chunks per subscribe message, so a large band fits a frame.
const CHUNKS_PER_MESSAGE: usize = 4096;
/// Pieces waiting for a directory lookup, at most; beyond, new ones are dropped (counted).
const MAX_PARKED: usize = 10_000;
/// An account the directory did not know is not looked up again for this long.
const NEGATIVE_TTL: Duration = Duration::from_secs(1);

/// Accounts grouped by what they may see of one entity change: (types sent, types removed) ->
/// (audience kind, accounts).
type SameView = BTreeMap<(Vec<u32>, Vec<u32>), (AudienceKind, Vec<String>)>;

/// One peer sidecar as this node knows it.
#[derive(Default)]
pub(crate) struct PeerState {
    pub addr: Option<String>,
    pub link: Option<LinkId>,
    /// Set while this node dials the peer (it has the higher id).
    pub dialer: Option<CancellationToken>,
}

fn vec3(p: Position) -> mesh::MeshVec3 {
    mesh::MeshVec3 {
        x: p.x,
        y: p.y,
        z: p.z,
    }
}

fn position(v: &mesh::MeshVec3) -> Position {
    Position::new(v.x, v.y, v.z)
}

fn chunk_refs(chunks: &[ChunkPos]) -> Vec<mesh::ChunkRef> {
    chunks
        .iter()
        .map(|c| mesh::ChunkRef { x: c.x, y: c.y })
        .collect()
}

/// The full public state of `e`, as a subscriber's snapshot.
fn full_state(e: &Entity) -> mesh::EntityState {
    mesh::EntityState {
        entity_id: e.id,
        entity_epoch: e.epoch,
        full: true,
        position: Some(vec3(e.position)),
        components: e
            .components
            .iter()
            .filter(|(_, c)| c.audience.is_public())
            .map(|(t, c)| mesh::PublicComponent {
                r#type: *t,
                payload: c.payload.clone(),
            })
            .collect(),
        removed_types: vec![],
        owner_account: e.owner_account.clone(),
        is_master: e.is_master,
        parent_id: e.parent_id,
    }
}

/// This tick's public changes of `e`; `None` when a subscriber has nothing to learn.
fn public_delta(e: &Entity, ch: &EntityChange) -> Option<mesh::EntityState> {
    let mut d = mesh::EntityState {
        entity_id: e.id,
        entity_epoch: e.epoch,
        position: ch.moved.then(|| vec3(e.position)),
        ..Default::default()
    };
    for (t, before) in &ch.components {
        match e.components.get(t) {
            Some(c) if c.audience.is_public() => d.components.push(mesh::PublicComponent {
                r#type: *t,
                payload: c.payload.clone(),
            }),
            _ => {
                if before.as_ref().is_some_and(Audience::is_public) {
                    d.removed_types.push(*t);
                }
            }
        }
    }
    (d.position.is_some() || !d.components.is_empty() || !d.removed_types.is_empty()).then_some(d)
}

fn public_components(list: Vec<mesh::PublicComponent>) -> Vec<(u32, Component)> {
    list.into_iter()
        .map(|c| {
            (
                c.r#type,
                Component {
                    audience: Audience::PublicInRange,
                    payload: c.payload,
                },
            )
        })
        .collect()
}

fn part_of(kind: i32) -> Part {
    match PieceKind::try_from(kind) {
        Ok(PieceKind::PieceEvent) => Part::Event,
        Ok(PieceKind::PieceMessage) => Part::Message,
        _ => Part::Delta,
    }
}

fn audience_label(kind: u32) -> &'static str {
    match AudienceKind::try_from(kind as i32) {
        Ok(AudienceKind::OwnerOnly) => "owner_only",
        Ok(AudienceKind::Accounts) => "accounts",
        Ok(AudienceKind::OwnerAndParty) => "owner_and_party",
        _ => "send",
    }
}

impl Node {
    // ------------------------------------------------------------------ links

    /// The peers with a live lease now; dials those with a higher id.
    pub(crate) fn on_peers(&mut self, peers: Vec<PeerInfo>) {
        let me = self.cfg.node_id;
        let live: BTreeMap<NodeId, String> =
            peers.into_iter().map(|p| (p.node, p.mesh_addr)).collect();
        for (node, state) in self.peers.iter_mut() {
            if !live.contains_key(node) {
                if let Some(d) = state.dialer.take() {
                    d.cancel();
                }
                state.addr = None;
            }
        }
        for (node, addr) in live {
            let state = self.peers.entry(node).or_default();
            if state.addr.as_deref() == Some(addr.as_str()) && (node < me || state.dialer.is_some())
            {
                continue;
            }
            state.addr = Some(addr.clone());
            if node > me {
                if let Some(d) = state.dialer.take() {
                    d.cancel();
                }
                if let Some(ctx) = &self.mesh_ctx {
                    let stop = ctx.shutdown.child_token();
                    state.dialer = Some(stop.clone());
                    self.tasks
                        .spawn(cluster::dial(node, addr, ctx.clone(), stop));
                }
            }
        }
    }

    /// A link to peer `node` is up (dialled or accepted): the newest link of a pair wins.
    pub(crate) fn on_peer_up(&mut self, link: LinkId, node: NodeId) {
        if let Some(old) = self.peers.get(&node).and_then(|p| p.link) {
            if old != link {
                self.close_link(old, "replaced by a newer link from the same peer");
            }
        }
        tracing::info!(link, peer = node, "peer link up");
        self.peers.entry(node).or_default().link = Some(link);
        // The link's hello named the partition this node started with; say which one it runs.
        self.send_peer(
            node,
            mesh_message::Body::PartitionAck(mesh::PartitionAck {
                partition_epoch: self.partition.epoch(),
            }),
        );
        let label = self.metrics.peer(node);
        self.metrics.peer_up.get_or_create(&label).set(1);
        self.metrics.peers_up.set(self.up_peers().len() as i64);
        self.metrics.peer_links.get_or_create(&label).inc();
        // The owner forgot this node's subscriptions with the last link: ask again, for a fresh
        // snapshot burst.
        let held = self.subs.of_owner(node);
        for part in held.chunks(CHUNKS_PER_MESSAGE) {
            self.send_peer(
                node,
                mesh_message::Body::Subscribe(mesh::Subscribe {
                    chunks: chunk_refs(part),
                }),
            );
        }
        // Gateways learn where the sessions of this node are, and owners who simulates whom.
        let moved: Vec<mesh_message::Body> = self
            .sessions
            .iter()
            .filter_map(|s| {
                Some(mesh_message::Body::SessionMoved(mesh::SessionMoved {
                    account: s.account.clone(),
                    session_epoch: s.epoch?,
                    gateway_node: self.cfg.node_id,
                }))
            })
            .collect();
        for m in moved {
            self.send_peer(node, m);
        }
        self.anchor_sent.retain(|account, _| {
            self.remote_players
                .get(account)
                .is_none_or(|r| r.gateway_node != node)
        });
        // Offers in doubt towards it get their answer now.
        self.resume_offers(node);
    }

    /// The link to `node` is gone: what it told this node is forgotten (its render ghosts vanish
    /// from clients at the next tick), and so are its subscriptions here.
    pub(crate) fn peer_down(&mut self, node: NodeId, link: LinkId, reason: &str) {
        let Some(p) = self.peers.get_mut(&node) else {
            return;
        };
        if p.link != Some(link) {
            return;
        }
        p.link = None;
        tracing::info!(link, peer = node, %reason, "peer link down");
        self.metrics
            .peer_up
            .get_or_create(&self.metrics.peer(node))
            .set(0);
        self.metrics.peers_up.set(self.up_peers().len() as i64);
        for id in self.table.ghosts_of(node) {
            if !self.ghost_orphaned(id) {
                let _ = self.table.despawn(id);
                self.fence.forget(id);
            }
        }
        self.subscribers.remove_node(node);
        self.metrics.subscribers.set(self.subscribers.len() as i64);
        self.replicas.retain(|_, nodes| {
            nodes.remove(&node);
            !nodes.is_empty()
        });
    }

    /// Queues `body` for peer `node`; false (and counted) when no link to it is up.
    pub(crate) fn send_peer(&mut self, node: NodeId, body: mesh_message::Body) -> bool {
        let Some(link) = self.peers.get(&node).and_then(|p| p.link) else {
            self.metrics.drop_msg("peer_down", 1);
            return false;
        };
        self.metrics.peer_message(node, "out");
        self.queue_for_link(link, body);
        true
    }

    fn up_peers(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(_, p)| p.link.is_some())
            .map(|(n, _)| *n)
            .collect()
    }

    pub(crate) fn broadcast(&mut self, body: mesh_message::Body) {
        for node in self.up_peers() {
            self.send_peer(node, body.clone());
        }
    }

    pub(crate) fn on_peer_message(&mut self, node: NodeId, body: mesh_message::Body) {
        use mesh_message::Body as B;
        self.metrics.peer_message(node, "in");
        match body {
            B::Heartbeat(_) => {}
            B::Subscribe(s) => self.on_subscribe(node, s.chunks),
            B::Unsubscribe(u) => self.on_unsubscribe(node, u.chunks),
            B::EntityState(s) => self.fence_entity_state(node, s),
            B::EntityGone(g) => self.fence_entity_gone(node, g),
            B::EntityMoved(m) => self.on_entity_moved(node, m),
            B::HandoffOffer(o) => self.on_handoff_offer(node, o),
            B::HandoffAck(a) => self.on_handoff_ack(node, a),
            B::HandoffRefused(r) => self.on_handoff_refused(node, r),
            B::PartitionAck(a) => {
                let e = self.peer_partition.entry(node).or_default();
                *e = (*e).max(a.partition_epoch);
            }
            B::EntityEvent(ev) => {
                if let Some(e) = self
                    .table
                    .get(ev.entity_id)
                    .filter(|e| e.origin == Some(node))
                {
                    self.tick_events.push(TickEvent {
                        entity_id: e.id,
                        chunk: e.chunk,
                        owner_account: e.owner_account.clone(),
                        audience: Audience::PublicInRange,
                        r#type: ev.r#type,
                        payload: ev.payload,
                    });
                }
            }
            B::PlayerJoin(j) => self.on_peer_player_join(node, j),
            B::PlayerLeave(l) => self.on_peer_player_leave(l),
            B::ForwardInput(i) => self.input_for_master(i),
            B::Anchor(a) => self.on_anchor(node, a),
            B::Routed(r) => self.on_routed(r),
            B::SessionMoved(m) => self.on_session_moved(m),
            B::SessionEnded(e) => {
                if self
                    .routes
                    .get(&e.account)
                    .is_some_and(|r| r.session_epoch == e.session_epoch)
                {
                    self.routes.remove(&e.account);
                }
            }
            other => {
                self.metrics.error("unexpected_message");
                tracing::warn!(peer = node, message = ?other, "a peer sent a message only a proxy sends; ignored");
            }
        }
    }

    // ------------------------------------------------------------------ owner: subscriptions

    fn on_subscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        for c in chunks {
            let chunk = self.cfg.world.normalise_chunk(ChunkPos { x: c.x, y: c.y });
            // This node's entities may stand up to the reach past its area.
            if distance_to_area(&self.cfg.world, &self.area, chunk) > self.cfg.reach_chunks() {
                self.metrics.drop_msg("subscribe_out_of_reach", 1);
                continue;
            }
            if !self.subscribers.add(node, chunk) {
                continue;
            }
            // The snapshot burst: every resident the node does not hold yet.
            let residents: Vec<u64> = self.table.residents(chunk).collect();
            for id in residents {
                let Some(e) = self.table.get_local(id) else {
                    continue;
                };
                if self.replicas.entry(id).or_default().insert(node) {
                    let state = full_state(e);
                    self.metrics.cross_node_updates.inc();
                    self.send_peer(node, mesh_message::Body::EntityState(state));
                    self.newly_held.entry(id).or_default().insert(node);
                }
            }
        }
    }

    fn on_unsubscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        self.forget_subscriptions(node, chunks);
        self.metrics.subscribers.set(self.subscribers.len() as i64);
    }

    fn forget_subscriptions(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        for c in chunks {
            let chunk = self.cfg.world.normalise_chunk(ChunkPos { x: c.x, y: c.y });
            if !self.subscribers.remove(node, chunk) {
                continue;
            }
            // The node drops its ghosts there itself; only the bookkeeping changes here.
            let residents: Vec<u64> = self.table.residents(chunk).collect();
            for id in residents {
                if let Some(nodes) = self.replicas.get_mut(&id) {
                    nodes.remove(&node);
                    if nodes.is_empty() {
                        self.replicas.remove(&id);
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
                if let Some(nodes) = self.replicas.remove(&id) {
                    for node in nodes {
                        self.metrics.cross_node_updates.inc();
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
            let target: BTreeSet<NodeId> = self.subscribers.of(e.chunk).collect();
            let held = self.replicas.remove(&id).unwrap_or_default();
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
                    let state = full.clone().expect("built when some node needs it");
                    frames.push((node, mesh_message::Body::EntityState(state)));
                    self.newly_held.entry(id).or_default().insert(node);
                } else if let Some(d) = &delta {
                    frames.push((node, mesh_message::Body::EntityState(d.clone())));
                }
            }
            if !target.is_empty() {
                self.replicas.insert(id, target);
            }
            for (node, body) in frames {
                self.metrics.cross_node_updates.inc();
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
            let Some(nodes) = self.replicas.get(&ev.entity_id).cloned() else {
                continue;
            };
            for node in nodes {
                self.metrics.cross_node_updates.inc();
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

    // ------------------------------------------------------------------ owner: routing

    /// Where `account`'s session is, as this node knows it.
    fn target(&self, account: &str) -> Target {
        if self.clients.key_of(account).is_some() {
            return Target::Local;
        }
        match self.routes.get(account) {
            Some(r) if r.gateway_node != self.cfg.node_id => Target::Remote {
                gateway: r.gateway_node,
                session_epoch: r.session_epoch,
            },
            _ => Target::Unknown,
        }
    }

    /// Routes this tick's non-public component changes and events of local entities, and the
    /// game's `Send`s, to the gateways of the accounts they name. Returns the sends for the local
    /// fold, narrowed to accounts with a session here.
    pub(crate) fn route_tick(
        &mut self,
        changes: &TickChanges,
        events: &[TickEvent],
        sends: Vec<TickSend>,
    ) -> Vec<TickSend> {
        let mut pieces: Vec<Addressed> = Vec::new();
        // A client that newly sees an entity (its gateway just got it in full, or its session
        // just attached there) is owed the entity's current non-public state, not only changes.
        let newly_held = std::mem::take(&mut self.newly_held);
        let newly_attached = std::mem::take(&mut self.newly_attached);
        let whole = EntityChange {
            spawned: true,
            ..Default::default()
        };
        let mut ids: BTreeSet<u64> = changes.keys().chain(newly_held.keys()).copied().collect();
        if !newly_attached.is_empty() {
            ids.extend(
                self.table
                    .iter()
                    .filter(|e| e.origin.is_none())
                    .map(|e| e.id),
            );
        }
        let no_change = EntityChange::default();
        for id in ids {
            let Some(e) = self.table.get_local(id) else {
                continue;
            };
            let mut views = route::account_views(e, changes.get(&id).unwrap_or(&no_change));
            let held_by = newly_held.get(&id);
            for (account, view) in route::account_views(e, &whole) {
                let fresh = newly_attached.contains(&account)
                    || match self.target(&account) {
                        Target::Remote { gateway, .. } => {
                            held_by.is_some_and(|n| n.contains(&gateway))
                        }
                        _ => false,
                    };
                if fresh {
                    views.insert(account, view);
                }
            }
            // Accounts that see the same thing share one encoded delta.
            let mut groups: SameView = BTreeMap::new();
            for (account, (send, removed, kind)) in views {
                if self.clients.key_of(&account).is_some() {
                    continue;
                }
                groups
                    .entry((send, removed))
                    .or_insert((kind, Vec::new()))
                    .1
                    .push(account);
            }
            for ((send, removed), (kind, accounts)) in groups {
                let delta = EntityDelta {
                    entity_id: id,
                    kind: DeltaKind::Update as i32,
                    components: send
                        .iter()
                        .filter_map(|t| {
                            e.components.get(t).map(|c| ComponentData {
                                r#type: *t,
                                payload: c.payload.clone(),
                            })
                        })
                        .collect(),
                    removed_types: removed,
                    ..Default::default()
                };
                pieces.push(Addressed {
                    kind: PieceKind::PieceDelta,
                    audience: kind,
                    encoded: encode_delta(&delta).0,
                    accounts,
                });
            }
        }
        for ev in events {
            if ev.audience.is_public() || self.table.get_local(ev.entity_id).is_none() {
                continue;
            }
            let accounts: Vec<String> = ev
                .audience
                .named_accounts(&ev.owner_account)
                .filter(|a| self.clients.key_of(a).is_none())
                .map(str::to_string)
                .collect();
            if accounts.is_empty() {
                continue;
            }
            let encoded = encode_event(&EventData {
                entity_id: ev.entity_id,
                r#type: ev.r#type,
                payload: ev.payload.clone(),
            });
            pieces.push(Addressed {
                kind: PieceKind::PieceEvent,
                audience: route::kind_of(&ev.audience),
                encoded: encoded.0,
                accounts,
            });
        }
        let mut local_sends = Vec::with_capacity(sends.len());
        for send in sends {
            let (local, remote): (Vec<String>, Vec<String>) = send
                .accounts
                .into_iter()
                .partition(|a| self.clients.key_of(a).is_some());
            if !remote.is_empty() {
                let encoded = encode_message(&AccountMessage {
                    r#type: send.r#type,
                    payload: send.payload.clone(),
                });
                pieces.push(Addressed {
                    kind: PieceKind::PieceMessage,
                    audience: AudienceKind::Accounts,
                    encoded: encoded.0,
                    accounts: remote,
                });
            }
            if !local.is_empty() {
                local_sends.push(TickSend {
                    accounts: local,
                    r#type: send.r#type,
                    payload: send.payload,
                });
            }
        }
        if pieces.is_empty() {
            return local_sends;
        }
        let resolved = route::resolve(&pieces, |a| self.target(a));
        for (gateway, routed) in resolved.per_gateway {
            self.send_routed(gateway, routed);
        }
        for (account, index) in resolved.unknown {
            self.park(account, pieces[index].clone());
        }
        local_sends
    }

    fn send_routed(&mut self, gateway: NodeId, routed: mesh::Routed) {
        let kinds: BTreeSet<u32> = routed.pieces.iter().map(|p| p.audience).collect();
        if self.send_peer(gateway, mesh_message::Body::Routed(routed)) {
            self.metrics.routed_messages.inc();
            for k in kinds {
                self.metrics
                    .routed
                    .get_or_create(&crate::metrics::AudienceLabel {
                        audience: audience_label(k),
                    })
                    .inc();
            }
        }
    }

    /// Holds a piece for an account with no known route, and looks the account up.
    fn park(&mut self, account: String, piece: Addressed) {
        if self
            .unknown_until
            .get(&account)
            .is_some_and(|t| *t > Instant::now())
            || self.parked.len() >= MAX_PARKED
        {
            self.metrics.dropped_unknown_account.inc();
            self.metrics.drop_msg("unknown_account", 1);
            return;
        }
        if self.looking_up.insert(account.clone()) {
            let (stores, inbox) = (self.stores.clone(), self.inbox.clone());
            let who = account.clone();
            self.spawn_store(async move {
                let result = match tokio::time::timeout(
                    STORE_TIMEOUT,
                    stores.directory.lookup(&who),
                )
                .await
                {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err("no answer from the session directory".to_string()),
                };
                let _ = inbox
                    .send(NodeEvent::LookedUp {
                        account: who,
                        result,
                    })
                    .await;
            });
        }
        self.parked.push((account, piece));
    }

    pub(crate) fn on_looked_up(
        &mut self,
        account: String,
        result: Result<Option<SessionEntry>, String>,
    ) {
        self.looking_up.remove(&account);
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|(a, _)| *a == account);
        self.parked = rest;
        let entry = match result {
            Ok(Some(entry)) => {
                let newer = self
                    .routes
                    .get(&account)
                    .is_none_or(|r| r.session_epoch <= entry.session_epoch);
                if newer {
                    self.routes.insert(account.clone(), entry);
                }
                Some(entry)
            }
            Ok(None) => {
                self.unknown_until
                    .insert(account.clone(), Instant::now() + NEGATIVE_TTL);
                None
            }
            Err(e) => {
                self.metrics.error("store");
                tracing::warn!(%account, error = %e, "looking up a session failed");
                None
            }
        };
        for (_, piece) in mine {
            match entry {
                Some(r) if r.gateway_node != self.cfg.node_id => {
                    let routed = mesh::Routed {
                        pieces: vec![route::piece(
                            &piece,
                            vec![mesh::Recipient {
                                account: account.clone(),
                                session_epoch: r.session_epoch,
                            }],
                        )],
                    };
                    self.send_routed(r.gateway_node, routed);
                }
                _ => match self.clients.key_of(&account) {
                    Some(key) => {
                        self.clients
                            .inject(key, part_of(piece.kind as i32), Encoded(piece.encoded))
                    }
                    None => {
                        self.metrics.dropped_unknown_account.inc();
                        self.metrics.drop_msg("unknown_account", 1);
                    }
                },
            }
        }
    }

    /// Tells remote gateways where their players' avatars are when they spawn or change chunk.
    pub(crate) fn send_anchors(&mut self, changes: &TickChanges) {
        let mut due = Vec::new();
        for &id in changes.keys() {
            let Some(e) = self.table.get_local(id).filter(|e| e.is_master) else {
                continue;
            };
            let Some(r) = self.remote_players.get(&e.owner_account) else {
                continue;
            };
            if self.anchor_sent.get(&e.owner_account) != Some(&e.chunk) {
                due.push((e.owner_account.clone(), *r));
            }
        }
        for (account, r) in due {
            self.send_anchor(r.gateway_node, &account, r.session_epoch);
        }
    }

    /// Tells `gateway` where `account`'s master is, if this node writes it, and remembers the
    /// chunk told. The anchor carries the master's epoch, so a late one from a previous owner
    /// loses against it.
    pub(crate) fn send_anchor(&mut self, gateway: NodeId, account: &str, session_epoch: u64) {
        let Some(e) = self.table.master_of(account).filter(|e| e.origin.is_none()) else {
            return;
        };
        let (id, pos, chunk, epoch) = (e.id, e.position, e.chunk, e.epoch);
        let anchor = mesh_message::Body::Anchor(mesh::Anchor {
            account: account.to_string(),
            session_epoch,
            entity_id: id,
            position: Some(vec3(pos)),
            entity_epoch: epoch,
        });
        if self.send_peer(gateway, anchor) {
            self.anchor_sent.insert(account.to_string(), chunk);
        }
    }

    // ------------------------------------------------------------------ owner: remote players

    fn on_peer_player_join(&mut self, gateway: NodeId, j: mesh::PeerPlayerJoin) {
        let entry = SessionEntry {
            gateway_node: gateway,
            session_epoch: j.session_epoch,
        };
        if self
            .remote_players
            .get(&j.account)
            .is_some_and(|r| r.session_epoch > j.session_epoch)
        {
            return self.metrics.drop_msg("stale_session", 1);
        }
        self.remote_players.insert(j.account.clone(), entry);
        self.routes.insert(j.account.clone(), entry);
        self.anchor_sent.remove(&j.account);
        let join = local::PlayerJoin {
            account: j.account.clone(),
            session_epoch: j.session_epoch,
            last_position: j.last_position.map(|v| local::Vec3 {
                x: v.x,
                y: v.y,
                z: v.z,
            }),
        };
        if self.game.is_some() {
            self.to_game
                .push(sidecar_message::Body::PlayerJoin(join).into());
        }
        // An avatar that already exists (a new login) anchors the new session at once.
        self.send_anchor(gateway, &j.account, j.session_epoch);
    }

    fn on_peer_player_leave(&mut self, l: mesh::PeerPlayerLeave) {
        let Some(r) = self.remote_players.get(&l.account) else {
            // The avatar was handed on before the gateway heard: the leave follows it.
            let owner = self
                .table
                .master_of(&l.account)
                .and_then(|e| e.origin)
                .or_else(|| {
                    let id = self.departed_masters.get(&l.account)?;
                    Some(self.handoff_out.departed_to(*id)?.0)
                });
            if let Some(owner) = owner {
                self.send_peer(owner, mesh_message::Body::PlayerLeave(l));
            }
            return;
        };
        if r.session_epoch > l.session_epoch {
            return self.metrics.drop_msg("stale_session", 1);
        }
        self.remote_players.remove(&l.account);
        self.anchor_sent.remove(&l.account);
        self.leave_follows_handoff(&l.account, l.session_epoch, &l.reason);
        if self.game.is_some() {
            self.to_game.push(
                sidecar_message::Body::PlayerLeave(local::PlayerLeave {
                    account: l.account,
                    session_epoch: l.session_epoch,
                    reason: l.reason,
                })
                .into(),
            );
        }
    }

    // ------------------------------------------------------------------ gateway side

    /// The epoch of `account`'s session here, if it is attached.
    fn session_epoch(&self, account: &str) -> Option<(u64, u64)> {
        let key = self.clients.key_of(account)?;
        Some((key, self.sessions.get(key)?.epoch?))
    }

    fn on_anchor(&mut self, node: NodeId, a: mesh::Anchor) {
        match self.session_epoch(&a.account) {
            Some((_, epoch)) if epoch == a.session_epoch => {}
            _ => return self.metrics.drop_msg("stale_session", 1),
        }
        if self
            .master_epoch
            .get(&a.account)
            .is_some_and(|e| *e > a.entity_epoch)
        {
            // A late word from a previous owner of the master.
            return self.metrics.drop_msg("stale_anchor", 1);
        }
        let Some(p) = a.position.as_ref().map(position) else {
            return;
        };
        if node == self.cfg.node_id {
            return;
        }
        self.master_epoch.insert(a.account.clone(), a.entity_epoch);
        let chunk = self.cfg.world.chunk_of(Pos { x: p.x, y: p.y });
        self.clients.set_remote_anchor(&a.account, Some(chunk));
        self.master_owner.insert(a.account.clone(), node);
        self.anchor_pos.insert(a.account, [p.x, p.y, p.z]);
    }

    fn on_routed(&mut self, r: mesh::Routed) {
        for piece in r.pieces {
            let part = part_of(piece.kind);
            for to in &piece.recipients {
                match self.session_epoch(&to.account) {
                    Some((key, epoch)) if epoch == to.session_epoch => {
                        self.clients
                            .inject(key, part, Encoded(piece.encoded.clone()));
                    }
                    // A late message for an older session, or for a session that left.
                    _ => self.metrics.drop_msg("stale_session", 1),
                }
            }
        }
    }

    /// Another gateway holds `account` now: routes follow it, and an older session here is
    /// displaced (its avatar is released where it is simulated).
    fn on_session_moved(&mut self, m: mesh::SessionMoved) {
        let entry = SessionEntry {
            gateway_node: m.gateway_node,
            session_epoch: m.session_epoch,
        };
        match self.routes.get(&m.account) {
            Some(r) if r.session_epoch > m.session_epoch => {}
            Some(r) if *r == entry => {}
            _ => {
                self.routes.insert(m.account.clone(), entry);
                if m.gateway_node != self.cfg.node_id && self.game.is_some() {
                    self.newly_attached.insert(m.account.clone());
                }
            }
        }
        if let Some((key, epoch)) = self.session_epoch(&m.account) {
            if epoch < m.session_epoch {
                self.displace(key, "the account logged in on another gateway");
            }
        }
    }

    /// Tells every peer that `account` now has a session here.
    pub(crate) fn announce_session(&mut self, account: &str, epoch: u64) {
        self.broadcast(mesh_message::Body::SessionMoved(mesh::SessionMoved {
            account: account.to_string(),
            session_epoch: epoch,
            gateway_node: self.cfg.node_id,
        }));
    }

    pub(crate) fn announce_session_end(&mut self, account: &str, epoch: u64) {
        self.broadcast(mesh_message::Body::SessionEnded(mesh::SessionEnded {
            account: account.to_string(),
            session_epoch: epoch,
        }));
    }

    // ------------------------------------------------------------------ observer side

    pub(crate) fn on_entity_state(&mut self, node: NodeId, s: mesh::EntityState) {
        let existing = self.table.get(s.entity_id).map(|e| (e.origin, e.chunk));
        if matches!(existing, Some((None, _))) {
            return self.metrics.drop_msg("ghost_of_local_entity", 1);
        }
        let at = s.position.as_ref().map(position);
        let chunk = at
            .map(|p| self.cfg.world.chunk_of(Pos { x: p.x, y: p.y }))
            .or(existing.map(|e| e.1));
        // Only what lies in a chunk this node subscribes to from that owner.
        if chunk.is_none_or(|c| !self.subs.has(c, node)) {
            if existing.is_some_and(|e| e.0 == Some(node)) {
                tracing::debug!(
                    me = self.cfg.node_id,
                    entity = s.entity_id,
                    node,
                    ?chunk,
                    "ghost dropped: moved out of the subscribed chunks"
                );
                let _ = self.table.despawn(s.entity_id);
                self.fence.forget(s.entity_id);
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
                self.metrics.drop_msg("bad_entity_state", 1);
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
                self.metrics.drop_msg("bad_entity_state", 1);
            }
        } else {
            // A delta for an entity this node never got the full state of: the owner thinks it
            // is held here. Subscribing to the chunk afresh gets a full snapshot burst.
            self.metrics.drop_msg("ghost_unknown", 1);
            if let Some(c) = chunk {
                self.resync(c, node);
            }
        }
    }

    /// Asks `owner` for a fresh snapshot of `chunk` (at most once a second per pair).
    fn resync(&mut self, chunk: ChunkPos, owner: NodeId) {
        let now = crate::node::unix_ms();
        if self
            .resynced
            .get(&(chunk, owner))
            .is_some_and(|t| now < t + 1_000)
        {
            return;
        }
        self.resynced.retain(|_, t| now < *t + 1_000);
        self.resynced.insert((chunk, owner), now);
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
        if !(self.clients.take_views_changed() || self.subs_dirty) {
            return;
        }
        self.subs_dirty = false;
        let me = self.cfg.node_id;
        let mut wanted = self.band.clone();
        let viewed: Vec<ChunkPos> = self.clients.viewed_chunks().collect();
        for c in viewed {
            for n in self.owners_near(c) {
                if n != me {
                    wanted.insert((c, n));
                }
            }
        }
        let changes = self.subs.update(wanted);
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
                    self.fence.forget(id);
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
        self.metrics.subscriptions.set(self.subs.len() as i64);
    }

    /// Pushes the render ghosts in the interaction band to the game as simulation ghosts, with
    /// hysteresis and a minimum lifespan.
    pub(crate) fn step_sim_ghosts(&mut self, changes: &TickChanges, now_ms: u64) {
        if self.game.is_none() {
            self.sim.clear();
            return;
        }
        let mut ids: BTreeSet<u64> = self.sim.ids().into_iter().collect();
        for (&id, _) in changes.iter() {
            if self.table.get(id).is_none_or(|e| e.origin.is_some()) {
                ids.insert(id);
            }
        }
        let world = self.cfg.world;
        for id in ids {
            if self.adopting.contains_key(&id) {
                // Its game is adopting it: no longer a ghost to it.
                continue;
            }
            let ghost = self.table.get(id).filter(|e| e.origin.is_some());
            let distance = ghost.map(|e| distance_to_area(&world, &self.area, e.chunk));
            let ch = changes.get(&id);
            let step = self.sim.observe(now_ms, id, distance, ch.is_some());
            let msg = match (step, ghost) {
                (GhostStep::Enter, Some(e)) => {
                    sidecar_message::Body::GhostEnter(local::GhostEnter {
                        entity_id: id,
                        position: Some(local::Vec3 {
                            x: e.position.x,
                            y: e.position.y,
                            z: e.position.z,
                        }),
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
                        position: (ch.moved || ch.spawned).then_some(local::Vec3 {
                            x: e.position.x,
                            y: e.position.y,
                            z: e.position.z,
                        }),
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
            self.to_game.push(msg.into());
        }
        self.metrics.ghosts_sim.set(self.sim.len() as i64);
    }
}

fn local_component(t: u32, payload: &Bytes) -> local::Component {
    local::Component {
        r#type: t,
        payload: payload.clone(),
        audience: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn entity() -> Entity {
        Entity {
            id: 5,
            position: Position::new(1.0, 2.0, 0.0),
            chunk: ChunkPos { x: 0, y: 0 },
            owner_account: "alice".into(),
            is_master: true,
            parent_id: 0,
            components: BTreeMap::from([
                (
                    1,
                    Component {
                        audience: Audience::PublicInRange,
                        payload: Bytes::from_static(b"kind"),
                    },
                ),
                (
                    3,
                    Component {
                        audience: Audience::OwnerOnly,
                        payload: Bytes::from_static(b"inventory"),
                    },
                ),
            ]),
            origin: None,
            epoch: 1,
        }
    }

    #[test]
    fn owner_only_components_never_replicate() {
        let e = entity();
        let full = full_state(&e);
        assert_eq!(full.components.len(), 1);
        assert_eq!(full.components[0].r#type, 1);
        let ch = EntityChange {
            components: BTreeMap::from([(3, Some(Audience::OwnerOnly))]),
            ..Default::default()
        };
        assert!(
            public_delta(&e, &ch).is_none(),
            "an owner-only change is no public news"
        );
        // Public -> owner-only is a removal for subscribers.
        let ch = EntityChange {
            moved: true,
            components: BTreeMap::from([(3, Some(Audience::PublicInRange))]),
            ..Default::default()
        };
        let d = public_delta(&e, &ch).unwrap();
        assert_eq!((d.removed_types.clone(), d.components.len()), (vec![3], 0));
        assert!(d.position.is_some() && !d.full);
    }
}
