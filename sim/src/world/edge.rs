//! The geo-edge proxies: one real [`ProxyCore`] per geo in front of the geo's gateway sidecars.
//! Its gateway links are simulated mesh links to the sidecar cores (delay, breaks, a node's
//! death), a `LinkHello` each way; its boards are the simulator's store model; its client
//! connections are the simulated players, who send the real edge frames and read the real
//! `ServerFrame`s. A proxy that restarts is a new core, whose players log in again.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::edge::{
    client_message, server_message, ClientFrame, ClientInput, ClientMessage, CookieResponse,
    KickReason, Pong, ServerFrame, Transfer,
};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage, PeerRole};
use cellmesh_proxy::core::{
    BoardReply, BoardRequest, ConnId as ProxyConn, GatewayId, Input as ProxyInput, Now as ProxyNow,
    Output as ProxyOutput, ProxyCore,
};
use cellmesh_proxy::{GeosConfig, PeerGeo, ProxyConfig};
use cellmesh_sidecar::core::{Input, LinkId};
use cellmesh_world::handover::RttFigure;
use cellmesh_world::partition::NodeId;
use prost::Message;
use rand::Rng;

use super::{Ev, Far, Sim, Stream, INPUTS_STOP_BEFORE_END_MS, INSIDE_VIEW, START_UNIX_MS};

/// The login tokens' key, shared by the simulated login service and every proxy.
const TOKEN_SECRET: &str = "simulated-login-service-token-secret";
/// The attach attestations' ring, shared by every proxy and every gateway sidecar.
pub(super) const ATTEST_KEY: &str = "sim:simulated-attestation-key-of-the-mesh";
/// A proxy redials a gateway it lost after this long (ms, drawn).
const REDIAL_MS: (u64, u64) = (100, 400);
/// A player kicked off (its gateway gone with no other, its proxy gone) tries again after this
/// long (ms, drawn).
const RELOGIN_MS: (u64, u64) = (500, 1_500);
/// Pings in one far geo's figure for a client (its proxy's probe of the client).
const FAR_PROBE_PINGS: usize = 5;

/// One geo's proxy process.
pub(super) struct SimProxy {
    pub geo: usize,
    pub core: Option<ProxyCore>,
    /// Bumped at each start: events of an earlier process are dropped.
    pub incarnation: u32,
    /// When this process started: its monotonic clock counts from there.
    started: u64,
    timer_at: Option<u64>,
    /// Its gateways (by `GatewayId`): the geo's gateway nodes, then its fallback gateways.
    pub gateways: Vec<NodeId>,
    /// How many of `gateways` are its own (the rest are fallbacks, used while none is up).
    primaries: usize,
    /// The link to each gateway, up or on its way up (by `GatewayId`).
    links: Vec<Option<u64>>,
    /// Inputs read from its clients and not yet sent on to a gateway: (account, seq).
    held: BTreeSet<(String, u64)>,
}

/// A link between a proxy and a gateway sidecar (one ordered stream each way).
pub(super) struct ProxyLink {
    /// The proxy (its index) and its process.
    p: usize,
    inc: u32,
    gateway: GatewayId,
    node: NodeId,
    node_link: LinkId,
    /// Still carrying frames.
    pub up: bool,
    /// The proxy heard the gateway's hello (and was told the link is up).
    heard: bool,
    /// Broken: what is in flight is lost.
    broken: bool,
    last_to_node: u64,
    last_to_proxy: u64,
}

impl ProxyLink {
    pub fn node(&self) -> NodeId {
        self.node
    }
}

/// The proxies of a world: one per geo that has gateways, or fronts another geo's.
pub(super) fn proxies_of(s: &crate::Scenario) -> Vec<SimProxy> {
    let geos = s.geos.map_or(1, |g| g.names.len());
    (0..geos)
        .filter_map(|geo| {
            let mut gateways: Vec<NodeId> = match s.proxy_gateways.iter().find(|(g, _)| *g == geo) {
                Some((_, nodes)) => nodes.to_vec(),
                None => (1..=s.nodes)
                    .filter(|&n| s.geo_of(n) == geo)
                    .filter(|n| s.gateways.is_empty() || s.gateways.contains(n))
                    .collect(),
            };
            let primaries = gateways.len();
            if let Some((_, nodes)) = s.proxy_fallbacks.iter().find(|(g, _)| *g == geo) {
                gateways.extend_from_slice(nodes);
            }
            (primaries > 0).then(|| SimProxy {
                geo,
                core: None,
                incarnation: 0,
                started: 0,
                timer_at: None,
                links: vec![None; gateways.len()],
                gateways,
                primaries,
                held: BTreeSet::new(),
            })
        })
        .collect()
}

/// What a real proxy of `geo` is configured with here.
fn config_of(
    s: &crate::Scenario,
    geo: usize,
    gateways: &[NodeId],
    primaries: usize,
) -> ProxyConfig {
    let addr = |n: &NodeId| format!("node-{n}:7200");
    let name = s.geo_label(geo);
    let peers = s.geos.map_or(Vec::new(), |g| {
        (0..g.names.len())
            .filter(|&other| other != geo)
            .map(|other| PeerGeo {
                name: g.names[other].into(),
                proxies: format!("203.0.113.{}:7100", other + 1),
                board: "memory".into(),
            })
            .collect()
    });
    ProxyConfig {
        name: format!("proxy-{name}"),
        geo: name.into(),
        gateways: gateways[..primaries].iter().map(addr).collect(),
        fallback_gateways: gateways[primaries..].iter().map(addr).collect(),
        // Its players go home soon after a gateway of its own is back, within the run.
        fallback_return_ms: 2_000,
        token_secret: TOKEN_SECRET.into(),
        attest_keys: vec![ATTEST_KEY.into()],
        geos: GeosConfig {
            peers,
            // Nothing here measures a kernel's RTT.
            kernel_rtt: false,
            ..GeosConfig::default()
        },
        ..ProxyConfig::default()
    }
}

/// The address of client `c`'s connections.
fn peer_of(c: usize) -> std::net::SocketAddr {
    let c = c as u32 + 1;
    std::net::SocketAddr::from(([10, (c >> 16) as u8, (c >> 8) as u8, c as u8], 40_000))
}

fn frame_of(bodies: Vec<client_message::Body>) -> ClientFrame {
    ClientFrame {
        messages: bodies
            .into_iter()
            .map(|b| ClientMessage { body: Some(b) })
            .collect(),
    }
}

impl Sim<'_> {
    fn proxy_index(&self, geo: usize) -> Option<usize> {
        self.proxies.iter().position(|p| p.geo == geo)
    }

    /// The proxy client `c` plays through: its own geo's, or the first one.
    fn home_proxy(&self, c: usize) -> usize {
        self.proxy_index(self.s.client_geo(c)).unwrap_or(0)
    }

    fn proxy_live(&self, p: usize, inc: u32) -> bool {
        let x = &self.proxies[p];
        x.core.is_some() && x.incarnation == inc
    }

    fn proxy_now(&self, p: usize) -> ProxyNow {
        ProxyNow {
            mono: Duration::from_millis(self.now - self.proxies[p].started),
            unix_ms: START_UNIX_MS + self.now,
        }
    }

    /// Proxy `p`'s process starts: a new core, which dials every gateway.
    pub(super) fn start_proxy(&mut self, p: usize) {
        let geo = self.proxies[p].geo;
        let x = &self.proxies[p];
        let cfg = config_of(self.s, geo, &x.gateways, x.primaries);
        let seed = self.seed ^ ((geo as u64 + 1) << 40) ^ u64::from(self.proxies[p].incarnation);
        let core = ProxyCore::standalone(cfg, seed).expect("the simulated proxy's config");
        let now = self.now;
        let x = &mut self.proxies[p];
        x.incarnation += 1;
        x.core = Some(core);
        x.started = now;
        x.timer_at = None;
        x.links.iter_mut().for_each(|l| *l = None);
        let inc = x.incarnation;
        self.note(|| format!("proxy of geo {geo} starts"));
        for gateway in 0..self.proxies[p].gateways.len() {
            self.schedule(0, Ev::ProxyDial { p, inc, gateway });
        }
        self.proxy_drain(p);
    }

    /// Hands an input to proxy `p`'s core, then carries out what it asks for.
    pub(super) fn proxy_feed(&mut self, p: usize, input: ProxyInput) {
        let now = self.proxy_now(p);
        if let ProxyInput::ClientFrame { conn, frame, .. } = &input {
            if let Some(&c) = self.conn_client.get(conn) {
                let account = self.clients[c].account.clone();
                for m in &frame.messages {
                    if let Some(client_message::Body::Input(i)) = &m.body {
                        self.proxies[p].held.insert((account.clone(), i.seq));
                    }
                }
            }
        }
        if self.trace.is_some() {
            let d = describe_proxy_input(&input);
            let geo = self.proxies[p].geo;
            self.note(|| format!("proxy {geo} <- {d}"));
        }
        let Some(core) = self.proxies[p].core.as_mut() else {
            return;
        };
        core.handle(now, input);
        self.proxy_drain(p);
    }

    fn proxy_drain(&mut self, p: usize) {
        let mut outs = Vec::new();
        while let Some(out) = self.proxies[p].core.as_mut().and_then(|c| c.poll_output()) {
            outs.push(out);
        }
        for out in far_rtts_in_conn_order(outs) {
            self.proxy_act(p, out);
        }
        let x = &mut self.proxies[p];
        let Some(due) = x.core.as_mut().and_then(|c| c.poll_timeout()) else {
            return;
        };
        let at = x.started + due;
        if x.timer_at.is_none_or(|t| at < t || t < self.now) {
            x.timer_at = Some(at);
            let inc = x.incarnation;
            self.schedule_at(at, Ev::ProxyTimer { p, inc });
        }
    }

    pub(super) fn proxy_timer(&mut self, p: usize, inc: u32) {
        if !self.proxy_live(p, inc) {
            return;
        }
        if self.proxies[p].timer_at.is_some_and(|t| t <= self.now) {
            self.proxies[p].timer_at = None;
            self.proxy_feed(p, ProxyInput::Timer);
        }
    }

    fn proxy_act(&mut self, p: usize, out: ProxyOutput) {
        let inc = self.proxies[p].incarnation;
        match out {
            ProxyOutput::ToClient { conn, frames } => self.send_to_client(conn, frames, false),
            ProxyOutput::CloseClient { conn, last } => {
                self.send_to_client(conn, last.into_iter().collect(), true)
            }
            ProxyOutput::ToLink {
                gateway, message, ..
            } => self.proxy_sends(p, gateway, message),
            ProxyOutput::Board { conn, request } => {
                let reply = self.board(p, request);
                let d = self.s.store_delay.draw(&mut self.rng) * 2;
                self.schedule(
                    d,
                    Ev::ProxyIn {
                        p,
                        inc,
                        input: ProxyInput::Board { conn, reply },
                    },
                );
            }
            ProxyOutput::ReadKernelRtt { conn } => {
                self.schedule(
                    0,
                    Ev::ProxyIn {
                        p,
                        inc,
                        input: ProxyInput::KernelRtt { conn, rtt: None },
                    },
                );
            }
            ProxyOutput::Event(e) => {
                if self.trace.is_some() {
                    let geo = self.proxies[p].geo;
                    self.note(|| format!("proxy {geo}: {e:?}"));
                }
            }
            ProxyOutput::AdmitFrames { .. }
            | ProxyOutput::Ready(_)
            | ProxyOutput::StopAccepting
            | ProxyOutput::Stopped
            | ProxyOutput::LoginStarted { .. }
            | ProxyOutput::LoginEnded { .. }
            | ProxyOutput::HandedOver { .. } => {}
        }
    }

    // ------------------------------------------------------------------ the boards

    /// The boards' answer to a request of proxy `p`: hints on the target geo's board, taken
    /// once; no probe targets; and what every other geo's proxy measured of a client (see
    /// [`Sim::far_rtt`]), so that the handover policy and the geo-aware director see the client
    /// from every geo.
    fn board(&mut self, p: usize, request: BoardRequest) -> BoardReply {
        let down = self.now < self.store.down_until;
        let geo = self.s.geo_label(self.proxies[p].geo);
        match request {
            BoardRequest::TakeHint { account, .. } => {
                let hint = (!down)
                    .then(|| self.hints.remove(&(geo.to_string(), account)))
                    .flatten();
                BoardReply::Hint(hint)
            }
            BoardRequest::OpenCookie { .. } => BoardReply::Cookie(Err("unsealed")),
            BoardRequest::ProbeTargets { .. } => BoardReply::ProbeTargets(Vec::new()),
            BoardRequest::Transfer { geo, hint, .. } => {
                if down {
                    return BoardReply::Transfer(Err("the board did not answer".into()));
                }
                self.hints.insert((geo.clone(), hint.account.clone()), hint);
                BoardReply::Transfer(Ok(Transfer {
                    host: format!("proxy-{geo}"),
                    port: 7100,
                    cookie: Bytes::new(),
                    geo,
                    server_name: String::new(),
                }))
            }
            BoardRequest::PublishFarRtt { .. } => BoardReply::Published(Ok(())),
            BoardRequest::FarRtts { account } => {
                let client = self.account_client.get(&account).copied();
                let (Some(c), false) = (client, down) else {
                    // A board that does not answer leaves the proxy with no far figure.
                    return BoardReply::FarRtts(HashMap::new());
                };
                let own = self.proxies[p].geo;
                let geos = self.s.geos.map_or(0, |g| g.names.len());
                let far = (0..geos)
                    .filter(|&g| g != own)
                    .map(|g| (self.s.geo_label(g).to_string(), self.far_rtt(c, g)))
                    .collect();
                BoardReply::FarRtts(far)
            }
        }
    }

    /// What the proxy of geo `geo` measured of client `c` when the client probed it: a few
    /// round trips over the client's way to that geo, drawn from the run's probe stream. The
    /// way is the client's access plus the one-way delay from its geo to that one
    /// ([`crate::Scenario::client_delay_to`]): a far proxy's figure is the client's own proxy's
    /// plus about the round trip between the two geos.
    fn far_rtt(&mut self, c: usize, geo: usize) -> RttFigure {
        let way = self.s.client_delay_to(c, geo);
        let mut rtts: Vec<u64> = (0..FAR_PROBE_PINGS)
            .map(|_| way.draw(&mut self.probe_rng) + way.draw(&mut self.probe_rng))
            .collect();
        rtts.sort_unstable();
        RttFigure {
            min_ms: rtts[0] as f64,
            median_ms: rtts[rtts.len() / 2] as f64,
            samples: FAR_PROBE_PINGS as u32,
        }
    }

    // ------------------------------------------------------------------ gateway links

    /// Proxy `p` dials its gateway `gateway`; a dead node is dialled again a little later.
    pub(super) fn proxy_dial(&mut self, p: usize, inc: u32, gateway: GatewayId) {
        if !self.proxy_live(p, inc) || self.proxies[p].links[gateway].is_some() {
            return;
        }
        let node = self.proxies[p].gateways[gateway];
        if !self.node(node).alive {
            let again = self.rng.random_range(REDIAL_MS.0..REDIAL_MS.1);
            self.schedule(again, Ev::ProxyDial { p, inc, gateway });
            return;
        }
        let geo = self.proxies[p].geo;
        let delay = self.s.proxy_delay_to(geo, node).draw(&mut self.rng);
        let uid = self.next_uid;
        self.next_uid += 1;
        let n = self.node(node);
        let node_link = n.next_link;
        n.next_link += 1;
        n.links.insert(node_link, Far::Proxy(uid));
        let node_inc = n.incarnation;
        let lease_epoch = n.lease.as_ref().map_or(0, |l| l.epoch);
        self.proxy_links.insert(
            uid,
            ProxyLink {
                p,
                inc,
                gateway,
                node,
                node_link,
                up: true,
                heard: false,
                broken: false,
                last_to_node: self.now + delay,
                last_to_proxy: self.now + 2 * delay,
            },
        );
        self.proxies[p].links[gateway] = Some(uid);
        // The gateway hears the proxy's hello first; the proxy checks the gateway's a round
        // trip after it dialled.
        let proxy_hello = mesh::LinkHello {
            version: Some(mesh::ProtocolVersion::current()),
            role: PeerRole::Proxy as i32,
            id: format!("proxy-{}", self.s.geo_label(geo)),
            geo: self.s.geo_label(geo).into(),
            partition_epoch: 0,
            node_id: 0,
            lease_epoch: 0,
            ..Default::default()
        };
        self.schedule(
            delay,
            Ev::Core {
                node,
                inc: node_inc,
                input: Input::LinkUp {
                    link: node_link,
                    hello: proxy_hello,
                    remote: format!("proxy-{}", self.s.geo_label(geo)),
                    rest: vec![],
                },
            },
        );
        let gateway_hello = mesh::LinkHello {
            version: Some(mesh::ProtocolVersion::current()),
            role: PeerRole::Sidecar as i32,
            id: node.to_string(),
            geo: self.s.geo_name(node).into(),
            partition_epoch: self.partition.epoch(),
            node_id: node,
            lease_epoch,
            ..Default::default()
        };
        self.schedule(
            2 * delay,
            Ev::ProxyLinkUp {
                uid,
                hello: gateway_hello,
            },
        );
    }

    /// The gateway's hello reaches the proxy: checked as the real driver does.
    pub(super) fn proxy_link_up(&mut self, uid: u64, hello: mesh::LinkHello) {
        let Some(l) = self.proxy_links.get(&uid) else {
            return;
        };
        let (p, inc, gateway) = (self.proxy_of_link(l), l.inc, l.gateway);
        if !l.up || !self.proxy_live(p, inc) {
            return;
        }
        self.proxy_links.get_mut(&uid).expect("above").heard = true;
        let compatible = hello
            .version
            .as_ref()
            .is_some_and(|v| v.major == mesh::ProtocolVersion::current().major);
        if !compatible || hello.role != PeerRole::Sidecar as i32 {
            self.check.violation(
                self.now,
                format!("proxy link {uid}: a gateway's hello the proxy refuses: {hello:?}"),
            );
            return;
        }
        self.proxy_feed(
            p,
            ProxyInput::LinkUp {
                gateway,
                node_id: hello.node_id,
            },
        );
    }

    fn proxy_of_link(&self, l: &ProxyLink) -> usize {
        l.p
    }

    /// Proxy `p` sends `message` to gateway `gateway`, in order after what it sent before.
    fn proxy_sends(&mut self, p: usize, gateway: GatewayId, message: MeshMessage) {
        if let Some(mesh_message::Body::Input(i)) = &message.body {
            self.proxy_lets_go(p, gateway, i.session_id, i.seq);
        }
        if let Some(mesh_message::Body::Attach(a)) = &message.body {
            if let Some(&c) = self.account_client.get(&a.account) {
                if let Some(l) =
                    self.proxies[p].links[gateway].and_then(|u| self.proxy_links.get(&u))
                {
                    self.link_sessions
                        .insert((l.node, l.node_link, a.session_id), c);
                }
            }
        }
        let uid = self.proxies[p].links[gateway];
        let Some(l) = uid
            .and_then(|u| self.proxy_links.get_mut(&u))
            .filter(|l| l.up)
        else {
            // The core sent before it heard the link went: what it carried is lost.
            if let Some(l) = uid.and_then(|u| self.proxy_links.get(&u)) {
                if let Some(mesh_message::Body::Input(i)) = &message.body {
                    let (node, link) = (l.node, l.node_link);
                    self.proxy_input_lost(node, link, i.session_id, i.seq);
                }
            }
            return;
        };
        let (node, link) = (l.node, l.node_link);
        let d = self
            .s
            .proxy_delay_to(self.proxies[p].geo, node)
            .draw(&mut self.rng);
        let l = self
            .proxy_links
            .get_mut(&uid.expect("above"))
            .expect("above");
        let at = (self.now + d).max(l.last_to_node);
        l.last_to_node = at;
        let inc = self.node(node).incarnation;
        self.schedule_at(
            at,
            Ev::Core {
                node,
                inc,
                input: Input::LinkFrame {
                    link,
                    messages: vec![message],
                },
            },
        );
    }

    /// An input proxy `p` sent on for session `session` of gateway `gateway`: it is the link's now.
    fn proxy_lets_go(&mut self, p: usize, gateway: GatewayId, session: u64, seq: u64) {
        let link = self.proxies[p].links[gateway].and_then(|u| self.proxy_links.get(&u));
        let client = link.and_then(|l| self.link_sessions.get(&(l.node, l.node_link, session)));
        if let Some(&c) = client {
            let account = self.clients[c].account.clone();
            self.proxies[p].held.remove(&(account, seq));
        }
    }

    /// A frame from a gateway on its proxy link.
    pub(super) fn gateway_sends(&mut self, uid: u64, frame: MeshFrame) {
        let Some(l) = self.proxy_links.get(&uid) else {
            return;
        };
        let d = self
            .s
            .proxy_delay_to(self.proxies[l.p].geo, l.node)
            .draw(&mut self.rng);
        let l = self.proxy_links.get_mut(&uid).expect("above");
        if !l.up {
            return;
        }
        let at = (self.now + d).max(l.last_to_proxy);
        l.last_to_proxy = at;
        self.schedule_at(at, Ev::ProxyFrame { uid, frame });
    }

    /// A gateway's frame reaches its proxy.
    pub(super) fn proxy_frame(&mut self, uid: u64, frame: MeshFrame) {
        let Some(l) = self.proxy_links.get(&uid) else {
            return;
        };
        let (p, inc, gateway) = (self.proxy_of_link(l), l.inc, l.gateway);
        let current =
            |sim: &Self| sim.proxy_live(p, inc) && sim.proxies[p].links[gateway] == Some(uid);
        if l.broken || !l.heard || !current(self) {
            return;
        }
        for message in frame.messages {
            if !current(self) {
                return;
            }
            self.proxy_feed(p, ProxyInput::LinkMessage { gateway, message });
        }
    }

    /// The link stops: the node hears it closed after `detect_ms` and the way's delay, the proxy
    /// too (unless it is gone itself); with `detect_ms` > 0 what is in flight is lost.
    pub(super) fn break_proxy_link(&mut self, uid: u64, reason: &str, detect_ms: u64) {
        let Some(l) = self.proxy_links.get_mut(&uid) else {
            return;
        };
        if !l.up {
            return;
        }
        l.up = false;
        if detect_ms > 0 {
            l.broken = true;
        }
        let (p, node, node_link, last_to_node, last_to_proxy) =
            (l.p, l.node, l.node_link, l.last_to_node, l.last_to_proxy);
        let geo = self.proxies[p].geo;
        let d = self.s.proxy_delay_to(geo, node).draw(&mut self.rng) + detect_ms;
        if self.node(node).links.contains_key(&node_link) {
            let inc = self.node(node).incarnation;
            let at = (self.now + d).max(last_to_node);
            self.schedule_at(
                at,
                Ev::ProxyLinkClosedAtNode {
                    uid,
                    node,
                    inc,
                    reason: reason.to_string(),
                },
            );
        }
        let at = (self.now + d).max(last_to_proxy);
        self.schedule_at(
            at,
            Ev::ProxyLinkDown {
                uid,
                reason: reason.to_string(),
            },
        );
    }

    pub(super) fn proxy_link_closed_at_node(
        &mut self,
        uid: u64,
        node: NodeId,
        inc: u32,
        reason: String,
    ) {
        let Some(l) = self.proxy_links.get(&uid) else {
            return;
        };
        let link = l.node_link;
        if !self.live(node, inc) || self.node(node).links.remove(&link).is_none() {
            return;
        }
        self.note(|| format!("n{node} proxy link {link} closed: {reason}"));
        self.feed(node, Input::LinkClosed { link, reason });
    }

    /// The proxy notices its link `uid` is gone: its sessions move, and it dials again.
    pub(super) fn proxy_link_down(&mut self, uid: u64, reason: String) {
        let Some(l) = self.proxy_links.get(&uid) else {
            return;
        };
        let (p, inc, gateway, heard) = (self.proxy_of_link(l), l.inc, l.gateway, l.heard);
        if !self.proxy_live(p, inc) || self.proxies[p].links[gateway] != Some(uid) {
            return;
        }
        self.proxies[p].links[gateway] = None;
        if heard {
            self.proxy_feed(
                p,
                ProxyInput::LinkDown {
                    gateway,
                    error: Some(reason),
                },
            );
        }
        let again = self.rng.random_range(REDIAL_MS.0..REDIAL_MS.1);
        self.schedule(again, Ev::ProxyDial { p, inc, gateway });
    }

    /// Node `id` closes its end of proxy link `uid` (it stops, or drops the link).
    pub(super) fn node_closes_proxy_link(&mut self, uid: u64) {
        self.break_proxy_link(uid, "closed by the gateway", 0);
    }

    // ------------------------------------------------------------------ the players

    /// Client `c` connects to its proxy (its own geo's) and logs in.
    pub(super) fn login(&mut self, c: usize) {
        let p = self.home_proxy(c);
        self.connect(c, p);
    }

    /// Client `c` opens a new connection to proxy `p`; frames of its older ones are not its
    /// session's any more.
    pub(super) fn connect(&mut self, c: usize, p: usize) {
        if self.proxies.get(p).is_none_or(|x| x.core.is_none()) {
            // Nobody listens: the client tries again a little later.
            let again = self.rng.random_range(RELOGIN_MS.0..RELOGIN_MS.1);
            self.schedule(again, Ev::ConnectTo { client: c, p });
            return;
        }
        let conn = self.next_conn;
        self.next_conn += 1;
        self.conn_client.insert(conn, c);
        let cl = &mut self.clients[c];
        cl.conn = conn;
        cl.proxy = p;
        cl.ended = true;
        cl.epoch = None;
        let account = cl.account.clone();
        let geo = self.proxies[p].geo;
        self.note(|| format!("{account} connects to the proxy of geo {geo} as conn {conn}"));
        self.client_to_proxy(
            c,
            ProxyInput::ClientOpened {
                conn,
                peer: peer_of(c),
            },
        );
    }

    /// Something client `c` does on its connection reaches its proxy, in order.
    fn client_to_proxy(&mut self, c: usize, input: ProxyInput) {
        let p = self.clients[c].proxy;
        let d = self
            .s
            .client_delay_to(c, self.proxies[p].geo)
            .draw(&mut self.rng);
        let at = self.fifo(Stream::FromClient(c), d);
        let inc = self.proxies[p].incarnation;
        self.schedule_at(at, Ev::ProxyIn { p, inc, input });
    }

    /// An input for proxy `p` arrives: a client's frame to a process that is gone is lost.
    pub(super) fn proxy_in(&mut self, p: usize, inc: u32, input: ProxyInput) {
        if self.proxy_live(p, inc) {
            return self.proxy_feed(p, input);
        }
        if let ProxyInput::ClientFrame { conn, frame, .. } = &input {
            if let Some(&c) = self.conn_client.get(conn) {
                let account = self.clients[c].account.clone();
                for m in &frame.messages {
                    if let Some(client_message::Body::Input(i)) = &m.body {
                        self.check.client_input_lost(&account, i.seq);
                    }
                }
            }
        }
    }

    /// Frames for connection `conn` leave the proxy for its client.
    fn send_to_client(&mut self, conn: ProxyConn, frames: Vec<Bytes>, close: bool) {
        let Some(&c) = self.conn_client.get(&conn) else {
            return;
        };
        let p = self.clients[c].proxy;
        let d = self
            .s
            .client_delay_to(c, self.proxies[p].geo)
            .draw(&mut self.rng);
        let at = self.fifo(Stream::ToClient(c), d);
        self.schedule_at(
            at,
            Ev::ToClient {
                client: c,
                conn,
                frames,
                close,
            },
        );
    }

    /// Client `c` reads frames of connection `conn`.
    pub(super) fn client_receives(
        &mut self,
        c: usize,
        conn: ProxyConn,
        frames: Vec<Bytes>,
        close: bool,
    ) {
        if self.clients[c].conn != conn {
            return;
        }
        for bytes in frames {
            if self.clients[c].conn != conn {
                return;
            }
            self.client_reads(c, conn, bytes);
        }
        if close && self.clients[c].conn == conn && !self.clients[c].leaving {
            // Closed with no word of where to go: the client logs in again.
            self.clients[c].ended = true;
            self.clients[c].conn = 0;
            let again = self.rng.random_range(RELOGIN_MS.0..RELOGIN_MS.1);
            self.schedule(again, Ev::Login { client: c });
        }
    }

    fn client_reads(&mut self, c: usize, conn: ProxyConn, bytes: Bytes) {
        let frame = match ServerFrame::decode(bytes.clone()) {
            Ok(f) => f,
            Err(e) => {
                let account = self.clients[c].account.clone();
                self.check
                    .violation(self.now, format!("{account}: undecodable frame: {e}"));
                return;
            }
        };
        let mut batches = false;
        for m in frame.messages {
            match m.body {
                Some(server_message::Body::Challenge(ch)) => {
                    let account = self.clients[c].account.clone();
                    let expiry = (START_UNIX_MS + self.now) / 1000 + 3_600;
                    let token =
                        cellmesh_proto::token::sign(TOKEN_SECRET.as_bytes(), &account, expiry);
                    let hello = cellmesh_proto::client::login_hello(&token, &ch.nonce)
                        .expect("a token of the login service");
                    self.clients[c].leaving = false;
                    self.client_sends(c, conn, client_message::Body::Hello(Box::new(hello)));
                }
                Some(server_message::Body::CookieRequest(_)) => {
                    // No cookie kept: the hint on the board is what a handover leaves.
                    self.client_sends(
                        c,
                        conn,
                        client_message::Body::Cookie(CookieResponse {
                            cookie: Bytes::new(),
                        }),
                    );
                }
                Some(server_message::Body::Welcome(w)) => {
                    let account = self.clients[c].account.clone();
                    self.note(|| {
                        format!(
                            "{account} welcomed on n{} as session {} epoch {}",
                            w.gateway_node, w.session_id, w.session_epoch
                        )
                    });
                    let starting = self.clients[c].epoch.is_none();
                    self.clients[c].begin(w.gateway_node);
                    self.clients[c].epoch = Some(w.session_epoch);
                    if starting {
                        let first = self.s.input_every_ms;
                        self.schedule(first, Ev::ClientInput { client: c, conn });
                    }
                }
                Some(server_message::Body::Ping(ping)) => self.client_sends(
                    c,
                    conn,
                    client_message::Body::Pong(Pong { nonce: ping.nonce }),
                ),
                Some(server_message::Body::Kick(k)) => {
                    let account = self.clients[c].account.clone();
                    let reason =
                        KickReason::try_from(k.reason).map_or("unknown", |r| r.as_str_name());
                    self.note(|| format!("{account} kicked ({reason}): {}", k.detail));
                    self.clients[c].ended = true;
                }
                Some(server_message::Body::Transfer(t)) => self.transferred(c, t),
                Some(server_message::Body::Batch(_)) => batches = true,
                Some(server_message::Body::Pong(_) | server_message::Body::Probe(_)) | None => {}
            }
        }
        if batches {
            self.client_views(c, &bytes);
        }
    }

    /// Client `c`'s view takes in a frame's batches, in order.
    pub(super) fn client_views(&mut self, c: usize, bytes: &Bytes) {
        if self.clients[c].ended {
            return;
        }
        let truth = self.truth();
        // Where the avatar is, and where the client sees it: through an outage it stands
        // still in the view while the real one walks on, and the view follows what the
        // client sees. Only a vanish close to both is wrong.
        let avatar_at: Vec<(f64, f64)> = self.clients[c]
            .avatar
            .map(|id| {
                [truth.get(&id), self.clients[c].seen.get(&id)]
                    .into_iter()
                    .flatten()
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        let world = self.world;
        let wrong = self.clients[c].on_frame(
            self.now,
            bytes,
            &world,
            INSIDE_VIEW,
            |id| truth.get(&id).copied(),
            &avatar_at,
        );
        for w in wrong {
            self.check.violation(self.now, w);
        }
    }

    /// The proxy sent client `c` to another geo: it connects there, its avatar to be found again.
    fn transferred(&mut self, c: usize, t: Transfer) {
        let account = self.clients[c].account.clone();
        self.note(|| format!("{account} is transferred to geo {}", t.geo));
        let geo = self
            .s
            .geos
            .and_then(|g| g.names.iter().position(|n| *n == t.geo));
        let Some(p) = geo.and_then(|g| self.proxy_index(g)) else {
            self.check.violation(
                self.now,
                format!("{account}: transferred to unknown geo {}", t.geo),
            );
            return;
        };
        let cl = &mut self.clients[c];
        cl.ended = true;
        cl.leaving = true;
        cl.keep_avatar = cl.avatar;
        let rtt = 2 * self.s.client_delay_to(c, self.proxies[p].geo).base_ms;
        self.schedule(rtt + 50, Ev::ConnectTo { client: c, p });
    }

    fn client_sends(&mut self, c: usize, conn: ProxyConn, body: client_message::Body) {
        self.client_to_proxy(
            c,
            ProxyInput::ClientFrame {
                conn,
                frame: frame_of(vec![body]),
                kernel_rtt: None,
            },
        );
    }

    /// Client `c` sends its next input on connection `conn`, while that is its session.
    pub(super) fn client_input(&mut self, c: usize, conn: ProxyConn) {
        if self.clients[c].conn != conn {
            return;
        }
        if self.now + INPUTS_STOP_BEFORE_END_MS > self.s.motion_ms + self.s.settle_ms {
            // The last inputs must land before the final count.
            return;
        }
        let world = self.world;
        let now = self.now;
        if let Some((seq, payload)) = self.clients[c].next_input(now, &world, &mut self.rng) {
            let account = self.clients[c].account.clone();
            let epoch = self.clients[c].epoch.unwrap_or(0);
            self.check.input_sent(&account, epoch, seq);
            self.stats.inputs_sent += 1;
            self.client_sends(
                c,
                conn,
                client_message::Body::Input(ClientInput { seq, payload }),
            );
        }
        let every = self.s.input_every_ms;
        self.schedule(every, Ev::ClientInput { client: c, conn });
    }

    /// The client's proxy hands its session over to another geo (see [`crate::Fault::Handover`]):
    /// its own geo if it plays elsewhere, any other geo with a proxy otherwise.
    pub(super) fn hand_over(&mut self, c: usize) {
        let Some(cl) = self.clients.get(c) else {
            return;
        };
        if cl.ended || cl.epoch.is_none() {
            return;
        }
        let from = self.proxies[cl.proxy].geo;
        let home = self.s.client_geo(c);
        let mut targets: Vec<usize> = self
            .proxies
            .iter()
            .filter(|x| x.geo != from && x.core.is_some())
            .map(|x| x.geo)
            .collect();
        targets.sort_by_key(|&g| (g != home, g));
        let Some(&to) = targets.first() else {
            return;
        };
        let account = cl.account.clone();
        let p = cl.proxy;
        let geo = self.s.geo_label(to).to_string();
        self.note(|| format!("{account} is handed over to geo {geo}"));
        self.proxy_feed(p, ProxyInput::HandOver { account, geo });
    }

    /// Proxy `p`'s process dies (see [`crate::Fault::ProxyRestart`]): its links close at once (its
    /// sockets go with it), its clients' connections end, and a new process starts `down_ms`
    /// later, to which they log in again.
    pub(super) fn proxy_restart(&mut self, p: usize, down_ms: u64) {
        if self.proxies[p].core.take().is_none() {
            return;
        }
        let geo = self.proxies[p].geo;
        self.note(|| format!("the proxy of geo {geo} dies"));
        // What it held of its clients' inputs dies with it.
        let held = std::mem::take(&mut self.proxies[p].held);
        for (account, seq) in held {
            self.check.client_input_lost(&account, seq);
        }
        let links: Vec<u64> = self.proxies[p].links.iter().flatten().copied().collect();
        for uid in links {
            // Reset at once: nothing in flight arrives.
            self.break_proxy_link(uid, "connection reset", 1);
        }
        self.proxies[p].links.iter_mut().for_each(|l| *l = None);
        for c in 0..self.clients.len() {
            if self.clients[c].proxy == p && self.clients[c].conn != 0 {
                self.clients[c].ended = true;
                self.clients[c].conn = 0;
                let again = down_ms + self.rng.random_range(0..400);
                self.schedule(again, Ev::ConnectTo { client: c, p });
            }
        }
        self.schedule(down_ms, Ev::ProxyBack { p });
    }

    /// At the end: inputs still in a proxy never reached a game.
    pub(super) fn inputs_left_in_proxies(&mut self) {
        for p in 0..self.proxies.len() {
            let held = std::mem::take(&mut self.proxies[p].held);
            for (account, seq) in held {
                self.check.client_input_lost(&account, seq);
            }
        }
    }

    /// A client's input on its way over link `link` to node `node` that will not be read there:
    /// lost with the link or the node.
    pub(super) fn proxy_input_lost(&mut self, node: NodeId, link: LinkId, session: u64, seq: u64) {
        if let Some(&c) = self.link_sessions.get(&(node, link, session)) {
            let account = self.clients[c].account.clone();
            self.check.client_input_lost(&account, seq);
        }
    }
}

/// `outs` with the requests for far RTTs in connection order, each in one of the places those
/// took. The core asks for them session by session in the order of a hash map, which differs
/// from one run to the next; the boards' answers and their delays are drawn in turn, so that
/// order would make two runs of one seed differ.
fn far_rtts_in_conn_order(outs: Vec<ProxyOutput>) -> Vec<ProxyOutput> {
    let far_rtts = |o: &ProxyOutput| match o {
        ProxyOutput::Board {
            conn,
            request: BoardRequest::FarRtts { .. },
        } => Some(*conn),
        _ => None,
    };
    let mut slots: Vec<Option<ProxyOutput>> = outs.into_iter().map(Some).collect();
    let at: Vec<usize> = (0..slots.len())
        .filter(|&i| slots[i].as_ref().and_then(far_rtts).is_some())
        .collect();
    let mut asked: Vec<ProxyOutput> = at.iter().filter_map(|&i| slots[i].take()).collect();
    asked.sort_by_key(|o| far_rtts(o));
    for (i, o) in at.into_iter().zip(asked) {
        slots[i] = Some(o);
    }
    slots.into_iter().flatten().collect()
}

fn describe_proxy_input(input: &ProxyInput) -> String {
    match input {
        ProxyInput::ClientFrame { conn, frame, .. } => {
            let kinds: Vec<&str> = frame
                .messages
                .iter()
                .map(|m| match &m.body {
                    Some(client_message::Body::Hello(_)) => "hello",
                    Some(client_message::Body::Input(_)) => "input",
                    Some(client_message::Body::Ping(_)) => "ping",
                    Some(client_message::Body::Pong(_)) => "pong",
                    Some(client_message::Body::Bye(_)) => "bye",
                    Some(client_message::Body::Cookie(_)) => "cookie",
                    None => "?",
                })
                .collect();
            format!("conn {conn}: {}", kinds.join(" "))
        }
        ProxyInput::LinkMessage { gateway, message } => match &message.body {
            Some(mesh_message::Body::ToClient(t)) => {
                format!("gateway {gateway}: to session {}", t.session_id)
            }
            Some(b) => format!(
                "gateway {gateway}: {}",
                super::describe_mesh(&MeshMessage::from(b.clone()))
            ),
            None => format!("gateway {gateway}: ?"),
        },
        ProxyInput::Board {
            conn,
            reply: BoardReply::FarRtts(far),
        } => {
            // In geo order: a map's own order differs from one run to the next.
            let far: std::collections::BTreeMap<_, _> = far.iter().collect();
            format!("conn {conn}: far RTTs {far:?}")
        }
        other => format!("{other:?}"),
    }
}
