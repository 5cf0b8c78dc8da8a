//! The node's side of the peer protocol (docs/mesh.md#peer-links): what it sends other sidecars and what
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

use rustc_hash::FxHashMap as HashMap;

use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::partition::NodeId;

use super::avatars::PROXY_LINK_LOST;
use super::wire::*;
use super::*;
use crate::model::audience::Audience;
use crate::model::fold::TickEvent;

/// A peer sidecar with a live lease: where to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    pub node: NodeId,
    pub mesh_addr: String,
    /// The geo the peer serves in, as its record says (empty: not said).
    pub geo: String,
}

/// One peer sidecar as this node knows it.
#[derive(Default)]
pub(crate) struct PeerState {
    pub addr: Option<String>,
    pub link: Option<LinkId>,
    /// Set while this node dials the peer (it has the lower id).
    pub dialling: bool,
    /// When the current link came up (monotonic ms).
    pub up_since_ms: u64,
}

/// An established mesh link, to a proxy or to a peer sidecar.
pub(crate) struct Link {
    /// The peer sidecar's node id, for a link to another sidecar (`None`: a proxy).
    pub peer: Option<NodeId>,
    pub hello: mesh::LinkHello,
    pub remote: String,
    pub sessions: BTreeSet<SessionKey>,
}

/// The node's links: to proxies (carrying sessions) and to its peer sidecars.
pub(crate) struct Mesh {
    pub links: BTreeMap<LinkId, Link>,
    pub peers: BTreeMap<NodeId, PeerState>,
    /// Whether this node has peers at all (a lone node owns the whole world).
    pub clustered: bool,
    /// The partition epoch each peer acknowledged (BigWorld's `hasBeenCreated`).
    pub peer_partition: HashMap<NodeId, u64>,
}

impl Mesh {
    pub fn new(clustered: bool) -> Self {
        Self {
            links: BTreeMap::new(),
            peers: BTreeMap::new(),
            clustered,
            peer_partition: HashMap::default(),
        }
    }

    /// The links to proxies (not to peer sidecars).
    pub(crate) fn proxy_links(&self) -> impl Iterator<Item = LinkId> + '_ {
        self.links
            .iter()
            .filter(|(_, l)| l.peer.is_none())
            .map(|(id, _)| *id)
    }
}

impl Core {
    // ------------------------------------------------------------------ links

    pub(crate) fn on_link_up(&mut self, link: LinkId, hello: mesh::LinkHello, remote: String) {
        if self.shutting_down {
            self.cx.emit(Output::ReleaseLink { link });
            return;
        }
        let peer = (hello.role == mesh::PeerRole::Sidecar as i32).then_some(hello.node_id);
        if let Some(node) = peer {
            self.mesh.peer_partition.insert(node, hello.partition_epoch);
            if !hello.geo.is_empty() {
                // Kept when the link drops: where an avatar is simulated is reported by geo.
                self.gateway.node_geo.insert(node, hello.geo.clone());
            }
        }
        if peer.is_none() {
            tracing::info!(link, proxy = %hello.id, %remote, "proxy link up");
        }
        self.mesh.links.insert(
            link,
            Link {
                peer,
                hello,
                remote,
                sessions: Default::default(),
            },
        );
        match peer {
            Some(node) => self.on_peer_up(link, node),
            None => self.admission.tell(&mut self.cx, link),
        }
    }

    /// A link is gone (closed by the proxy, dead, or too slow): its sessions are detached.
    pub(crate) fn close_link(&mut self, link: LinkId, reason: &str) {
        let Some(l) = self.mesh.links.remove(&link) else {
            return;
        };
        self.cx.emit(Output::KillLink { link });
        self.cx.out.to_links.remove(&link);
        if let Some(node) = l.peer {
            return self.peer_down(node, link, reason);
        }
        tracing::info!(link, proxy = %l.hello.id, %reason, "proxy link closed");
        for key in l.sessions {
            self.end_session(key, &format!("{PROXY_LINK_LOST}: {reason}"));
        }
    }

    /// The peers with a live lease now; dials those with a higher id.
    pub(crate) fn on_peers(&mut self, peers: Vec<PeerInfo>) {
        let me = self.cx.config.node_id;
        for p in &peers {
            if !p.geo.is_empty() {
                // Kept after the peer dies: its geo's decider restores it.
                self.restore.geo_of.insert(p.node, p.geo.clone());
            }
        }
        let live: BTreeMap<NodeId, String> =
            peers.into_iter().map(|p| (p.node, p.mesh_addr)).collect();
        let mut outputs = Vec::new();
        for (node, state) in self.mesh.peers.iter_mut() {
            if !live.contains_key(node) {
                if std::mem::take(&mut state.dialling) {
                    outputs.push(Output::StopDial { node: *node });
                }
                state.addr = None;
            }
        }
        for (node, addr) in live {
            let state = self.mesh.peers.entry(node).or_default();
            if state.addr.as_deref() == Some(addr.as_str()) && (node < me || state.dialling) {
                continue;
            }
            state.addr = Some(addr.clone());
            if node > me && self.mesh.clustered {
                // A new address replaces the dialler.
                state.dialling = true;
                outputs.push(Output::Dial { node, addr });
            }
        }
        for o in outputs {
            self.cx.emit(o);
        }
    }

    /// A link to peer `node` is up (dialled or accepted): the newest link of a pair wins.
    pub(crate) fn on_peer_up(&mut self, link: LinkId, node: NodeId) {
        if let Some(old) = self.mesh.peers.get(&node).and_then(|p| p.link) {
            if old != link {
                self.close_link(old, "replaced by a newer link from the same peer");
            }
        }
        tracing::info!(link, peer = node, "peer link up");
        let now = self.cx.now.mono_ms;
        let p = self.mesh.peers.entry(node).or_default();
        p.link = Some(link);
        p.up_since_ms = now;
        // The link's hello named the partition this node started with; say which one it runs.
        self.send_peer(
            node,
            mesh_message::Body::PartitionAck(mesh::PartitionAck {
                partition_epoch: self.authority.partition.epoch(),
            }),
        );
        let label = self.cx.metrics.peer(node);
        self.cx.metrics.peer_up.get_or_create(&label).set(1);
        self.cx.metrics.peers_up.set(self.up_peers().len() as i64);
        self.cx.metrics.peer_links.get_or_create(&label).inc();
        self.resend_resolutions(node);
        // The owner forgot this node's subscriptions with the last link: ask again, for a fresh
        // snapshot burst.
        let held = self.replication.subs.of_owner(node);
        for part in held.chunks(super::replication::CHUNKS_PER_MESSAGE) {
            self.send_peer(
                node,
                mesh_message::Body::Subscribe(mesh::Subscribe {
                    chunks: chunk_refs(part),
                }),
            );
        }
        // Gateways learn where the sessions of this node are, and owners who simulates whom.
        let moved: Vec<mesh_message::Body> = self
            .gateway
            .sessions
            .iter()
            .filter_map(|s| {
                Some(mesh_message::Body::SessionMoved(mesh::SessionMoved {
                    account: s.account.clone(),
                    session_epoch: s.epoch?,
                    gateway_node: self.cx.config.node_id,
                    new_avatar: false,
                }))
            })
            .collect();
        for m in moved {
            self.send_peer(node, m);
        }
        self.routing.anchor_sent.retain(|account, _| {
            self.routing
                .remote_players
                .get(account)
                .is_none_or(|r| r.gateway_node != node)
        });
        // Anchors sent while the link was down were lost, so that gateway's views still stand
        // where its players' avatars were then (or where a previous owner last saw them). They
        // are re-anchored now, not at the avatar's next change: a frozen or idle avatar has none,
        // and a moving one's comes after this node has told the gateway that the ghosts outside
        // the stale view are gone (the avatar itself included).
        let mut players: Vec<(String, u64)> = self
            .routing
            .remote_players
            .iter()
            .filter(|(_, r)| r.gateway_node == node)
            .map(|(account, r)| (account.clone(), r.session_epoch))
            .collect();
        players.sort();
        for (account, session_epoch) in players {
            self.send_anchor(node, &account, session_epoch);
        }
        // Offers in doubt towards it get their answer now.
        self.resume_offers(node);
    }

    /// The link to `node` is gone: its subscriptions here are forgotten, and its render ghosts go
    /// stale until the link is back.
    pub(crate) fn peer_down(&mut self, node: NodeId, link: LinkId, reason: &str) {
        let Some(p) = self.mesh.peers.get_mut(&node) else {
            return;
        };
        if p.link != Some(link) {
            return;
        }
        p.link = None;
        tracing::info!(link, peer = node, %reason, "peer link down");
        self.cx
            .metrics
            .peer_up
            .get_or_create(&self.cx.metrics.peer(node))
            .set(0);
        self.cx.metrics.peers_up.set(self.up_peers().len() as i64);
        // Its render ghosts stay, stale, so clients see no vanish: the subscriptions renewed when
        // the link is back refresh them (see `sweep_stale_ghosts`).
        let now = self.cx.now.mono_ms;
        for id in self.table.ghosts_of(node) {
            if !self.ghost_orphaned(id) {
                self.replication.stale.entry(id).or_insert(now);
            }
        }
        self.replication.subscribers.remove_node(node);
        self.cx
            .metrics
            .subscribers
            .set(self.replication.subscribers.len() as i64);
        self.replication.replicas.retain(|_, nodes| {
            nodes.remove(&node);
            !nodes.is_empty()
        });
    }

    /// Queues `body` for peer `node`; false (and counted) when no link to it is up.
    pub(crate) fn send_peer(&mut self, node: NodeId, body: mesh_message::Body) -> bool {
        let sent = self.try_send_peer(node, body);
        if !sent {
            self.cx.metrics.drop_msg("peer_down", 1);
        }
        sent
    }

    /// Queues `body` for peer `node`; false when no link to it is up (the caller counts it).
    pub(crate) fn try_send_peer(&mut self, node: NodeId, body: mesh_message::Body) -> bool {
        let Some(link) = self.mesh.peers.get(&node).and_then(|p| p.link) else {
            return false;
        };
        self.cx.metrics.peer_message(node, "out");
        self.cx.queue_for_link(link, body);
        true
    }

    pub(crate) fn up_peers(&self) -> Vec<NodeId> {
        self.mesh
            .peers
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
        self.cx.metrics.peer_message(node, "in");
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
                let e = self.mesh.peer_partition.entry(node).or_default();
                *e = (*e).max(a.partition_epoch);
            }
            B::EntityEvent(ev) => {
                if let Some(e) = self
                    .table
                    .get(ev.entity_id)
                    .filter(|e| e.origin == Some(node))
                {
                    self.game.tick_events.push(TickEvent {
                        entity_id: e.id,
                        chunk: e.chunk,
                        owner_account: e.owner_account.clone(),
                        audience: Audience::PublicInRange,
                        r#type: ev.r#type,
                        payload: ev.payload,
                    });
                }
            }
            B::RestoreQuery(q) => self.on_restore_query(node, q),
            B::RestoreReport(r) => self.on_restore_report(node, r),
            B::RestoreResolved(r) => self.on_restore_resolved(r),
            B::RestoreDone(d) => self.on_restore_done(d),
            B::PlayerJoin(j) => self.on_peer_player_join(node, j),
            B::PlayerLeave(l) => self.on_peer_player_leave(l),
            B::ForwardInput(i) => {
                self.cx.metrics.inputs_from_peers.inc();
                self.input_for_master(i)
            }
            B::Anchor(a) => self.on_anchor(node, a),
            B::EntityCommand(c) => self.route_command(c),
            B::EntityCommandResult(r) => self.on_command_result(r),
            B::Locate(l) => self.on_locate(node, l),
            B::Located(l) => self.on_located(node, l),
            B::Routed(r) => self.on_routed(r),
            B::SessionMoved(m) => self.on_session_moved(m),
            B::SessionEnded(e) => {
                if self
                    .routing
                    .routes
                    .get(&e.account)
                    .is_some_and(|r| r.session_epoch == e.session_epoch)
                {
                    self.routing.routes.remove(&e.account);
                }
                // The avatar of a session that ended is released even if the gateway's leave
                // never comes (it went to an owner the gateway was still waiting for), unless a
                // newer session joins it meanwhile (the proxy moved the session).
                if self
                    .routing
                    .remote_players
                    .get(&e.account)
                    .is_some_and(|r| r.session_epoch <= e.session_epoch)
                {
                    self.defer_leave(&e.account, e.session_epoch, "session_ended");
                }
            }
            other => {
                self.cx.metrics.error("unexpected_message");
                tracing::warn!(peer = node, message = ?other, "a peer sent a message only a proxy sends; ignored");
            }
        }
    }
}
