//! The node's links (docs/mesh.md#peer-links): to proxies, which carry sessions, and to its peer
//! sidecars. This part keeps which links are up, which peers it dials and what partition each
//! peer acknowledged, and sends to peers; what a peer's link coming up or going down means for
//! the other parts, and what a peer's message asks of them, the core routes.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;
use serde_json::json;

use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::partition::NodeId;

use super::context::Context;
use super::{LinkId, Output, SessionKey};

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
struct PeerState {
    addr: Option<String>,
    link: Option<LinkId>,
    /// Set while this node dials the peer (it has the lower id).
    dialling: bool,
    /// When the current link came up (monotonic ms).
    up_since_ms: u64,
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
    links: BTreeMap<LinkId, Link>,
    peers: BTreeMap<NodeId, PeerState>,
    /// Whether this node has peers at all (a lone node owns the whole world).
    clustered: bool,
    /// The partition epoch each peer acknowledged (BigWorld's `hasBeenCreated`).
    peer_partition: HashMap<NodeId, u64>,
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

    /// Whether this node has peers at all.
    pub(crate) fn clustered(&self) -> bool {
        self.clustered
    }

    /// The links to proxies (not to peer sidecars).
    pub(crate) fn proxy_links(&self) -> impl Iterator<Item = LinkId> + '_ {
        self.links
            .iter()
            .filter(|(_, l)| l.peer.is_none())
            .map(|(id, _)| *id)
    }

    /// An established link, to a proxy or a peer.
    pub(crate) fn link(&self, link: LinkId) -> Option<&Link> {
        self.links.get(&link)
    }

    /// A session attached over a proxy link.
    pub(crate) fn add_session(&mut self, link: LinkId, key: SessionKey) {
        if let Some(l) = self.links.get_mut(&link) {
            l.sessions.insert(key);
        }
    }

    /// A session no longer held over its proxy link.
    pub(crate) fn remove_session(&mut self, link: LinkId, key: SessionKey) {
        if let Some(l) = self.links.get_mut(&link) {
            l.sessions.remove(&key);
        }
    }

    /// The link up to peer `node`, if any.
    pub(crate) fn peer_link(&self, node: NodeId) -> Option<LinkId> {
        self.peers.get(&node).and_then(|p| p.link)
    }

    /// Whether a link to peer `node` is up.
    pub(crate) fn is_up(&self, node: NodeId) -> bool {
        self.peer_link(node).is_some()
    }

    /// The lease epoch the process at the end of the link up to peer `node` said it runs under.
    pub(crate) fn linked_lease(&self, node: NodeId) -> Option<u64> {
        let link = self.peer_link(node)?;
        self.links.get(&link).map(|l| l.hello.lease_epoch)
    }

    /// Since when the link to peer `node` has been up (monotonic ms), if it is.
    pub(crate) fn up_since_ms(&self, node: NodeId) -> Option<u64> {
        self.peers
            .get(&node)
            .filter(|p| p.link.is_some())
            .map(|p| p.up_since_ms)
    }

    /// The links up, by peer.
    pub(crate) fn peer_links(&self) -> BTreeMap<NodeId, LinkId> {
        self.peers
            .iter()
            .filter_map(|(n, p)| Some((*n, p.link?)))
            .collect()
    }

    /// The partition epoch peer `node` acknowledged (0: none).
    pub(crate) fn peer_partition(&self, node: NodeId) -> u64 {
        self.peer_partition.get(&node).copied().unwrap_or(0)
    }

    /// Whether every peer linked now acknowledged partition `epoch` or a later one.
    pub(crate) fn linked_peers_at(&self, epoch: u64) -> bool {
        self.peers
            .iter()
            .all(|(node, p)| p.link.is_none() || self.peer_partition(*node) >= epoch)
    }

    /// A peer's `PartitionAck`.
    pub(crate) fn on_partition_ack(&mut self, node: NodeId, epoch: u64) {
        let e = self.peer_partition.entry(node).or_default();
        *e = (*e).max(epoch);
    }

    // ------------------------------------------------------------------ links

    /// A link completed its handshake: the peer's node id, for a link to a peer sidecar.
    pub(crate) fn on_link_up(
        &mut self,
        link: LinkId,
        hello: mesh::LinkHello,
        remote: String,
    ) -> Option<NodeId> {
        let peer = (hello.role == mesh::PeerRole::Sidecar as i32).then_some(hello.node_id);
        match peer {
            Some(node) => {
                self.peer_partition.insert(node, hello.partition_epoch);
            }
            None => tracing::info!(link, proxy = %hello.id, %remote, "proxy link up"),
        }
        self.links.insert(
            link,
            Link {
                peer,
                hello,
                remote,
                sessions: Default::default(),
            },
        );
        peer
    }

    /// Lets a link go at once, dropping what is queued for it; the link as it was, if it was up.
    pub(crate) fn close(&mut self, cx: &mut Context, link: LinkId) -> Option<Link> {
        let l = self.links.remove(&link)?;
        cx.emit(Output::KillLink { link });
        cx.out.to_links.remove(&link);
        Some(l)
    }

    /// Every link, taken as the node shuts down.
    pub(crate) fn take_links(&mut self) -> Vec<LinkId> {
        std::mem::take(&mut self.links).into_keys().collect()
    }

    /// The peers with a live lease now, by node; dials those with a higher id.
    pub(crate) fn on_peers(&mut self, cx: &mut Context, live: BTreeMap<NodeId, String>) {
        let me = cx.config.node_id;
        for (node, state) in self.peers.iter_mut() {
            if !live.contains_key(node) {
                if std::mem::take(&mut state.dialling) {
                    cx.emit(Output::StopDial { node: *node });
                }
                state.addr = None;
            }
        }
        for (node, addr) in live {
            let state = self.peers.entry(node).or_default();
            if state.addr.as_deref() == Some(addr.as_str()) && (node < me || state.dialling) {
                continue;
            }
            state.addr = Some(addr.clone());
            if node > me && self.clustered {
                // A new address replaces the dialler.
                state.dialling = true;
                cx.emit(Output::Dial { node, addr });
            }
        }
    }

    /// `link` is now the link to peer `node` (the core has closed any older one); it hears
    /// which partition this node runs.
    pub(crate) fn on_peer_up(
        &mut self,
        cx: &mut Context,
        link: LinkId,
        node: NodeId,
        partition_epoch: u64,
    ) {
        tracing::info!(link, peer = node, "peer link up");
        let p = self.peers.entry(node).or_default();
        p.link = Some(link);
        p.up_since_ms = cx.now.mono_ms;
        // The link's hello named the partition this node started with; say which one it runs.
        self.send(
            cx,
            node,
            mesh_message::Body::PartitionAck(mesh::PartitionAck { partition_epoch }),
        );
        let label = cx.metrics.peer(node);
        cx.metrics.peer_up.get_or_create(&label).set(1);
        cx.metrics.peers_up.set(self.up_peers().len() as i64);
        cx.metrics.peer_links.get_or_create(&label).inc();
    }

    /// `link` to peer `node` is gone: false when it was not the peer's current link (a newer
    /// one replaced it), which changes nothing.
    pub(crate) fn on_peer_down(
        &mut self,
        cx: &mut Context,
        node: NodeId,
        link: LinkId,
        reason: &str,
    ) -> bool {
        let Some(p) = self.peers.get_mut(&node) else {
            return false;
        };
        if p.link != Some(link) {
            return false;
        }
        p.link = None;
        tracing::info!(link, peer = node, %reason, "peer link down");
        cx.metrics
            .peer_up
            .get_or_create(&cx.metrics.peer(node))
            .set(0);
        cx.metrics.peers_up.set(self.up_peers().len() as i64);
        true
    }

    // ------------------------------------------------------------------ sending

    /// Queues `body` for peer `node`; false (and counted) when no link to it is up.
    pub(crate) fn send(&self, cx: &mut Context, node: NodeId, body: mesh_message::Body) -> bool {
        let sent = self.try_send(cx, node, body);
        if !sent {
            cx.metrics.drop_msg("peer_down", 1);
        }
        sent
    }

    /// Queues `body` for peer `node`; false when no link to it is up (the caller counts it).
    pub(crate) fn try_send(
        &self,
        cx: &mut Context,
        node: NodeId,
        body: mesh_message::Body,
    ) -> bool {
        let Some(link) = self.peer_link(node) else {
            return false;
        };
        cx.metrics.peer_message(node, "out");
        cx.queue_for_link(link, body);
        true
    }

    /// A peer of `geo` a link is up to, chosen by `key` among them (so one geo's calls spread
    /// over its nodes); `None` when no link to that geo is up.
    pub(crate) fn linked_peer_in_geo(&self, geo: &str, key: &str) -> Option<NodeId> {
        let linked: Vec<NodeId> = self
            .peers
            .iter()
            .filter_map(|(node, p)| {
                let link = self.links.get(&p.link?)?;
                (link.hello.geo == geo).then_some(*node)
            })
            .collect();
        if linked.is_empty() {
            return None;
        }
        let spread = key.bytes().fold(0usize, |h, b| {
            h.wrapping_mul(31).wrapping_add(usize::from(b))
        });
        Some(linked[spread % linked.len()])
    }

    /// The peers a link is up to.
    pub(crate) fn up_peers(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(_, p)| p.link.is_some())
            .map(|(n, _)| *n)
            .collect()
    }

    /// Queues `body` for every peer a link is up to.
    pub(crate) fn broadcast(&self, cx: &mut Context, body: mesh_message::Body) {
        for node in self.up_peers() {
            self.send(cx, node, body.clone());
        }
    }

    /// The proxy links and the peers as `/state` shows them.
    pub(crate) fn state(&self) -> (serde_json::Value, serde_json::Value) {
        let links: Vec<serde_json::Value> = self
            .links
            .iter()
            .filter(|(_, l)| l.peer.is_none())
            .map(|(id, l)| {
                json!({"link": id, "proxy": l.hello.id, "geo": l.hello.geo, "remote": l.remote, "sessions": l.sessions.len()})
            })
            .collect();
        let peers: Vec<serde_json::Value> = self
            .peers
            .iter()
            .map(|(node, p)| {
                json!({"node": node, "addr": p.addr, "link": p.link, "up": p.link.is_some(), "dialling": p.dialling})
            })
            .collect();
        (links.into(), peers.into())
    }
}
