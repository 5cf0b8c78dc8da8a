//! The stand-in for the proxy, in the scenarios that do not run the real one yet (see
//! `Scenario::real_proxy`): the simulator writes what a proxy would send a gateway (attach
//! with attestation, inputs, a handover's detach and hinted attach) on a proxy link of its own,
//! and reads what the gateway sends back as the client.

use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage, PeerRole};
use cellmesh_sidecar::core::{Input, LinkId};
use cellmesh_world::partition::NodeId;
use rand::Rng;

use super::{Ev, Far, Sim, Stream, INPUTS_STOP_BEFORE_END_MS};

impl Sim<'_> {
    /// The proxy links to node `id` (its hello checked, as a real proxy's would be).
    pub(super) fn stand_in_link(&mut self, id: NodeId) {
        let n = self.node(id);
        let link = n.next_link;
        n.next_link += 1;
        n.links.insert(link, Far::StandIn);
        n.stand_in_link = Some(link);
        self.feed(
            id,
            Input::LinkUp {
                link,
                hello: mesh::LinkHello {
                    version: Some(mesh::ProtocolVersion::current()),
                    role: PeerRole::Proxy as i32,
                    id: "sim-proxy".into(),
                    geo: "sim".into(),
                    partition_epoch: 0,
                    node_id: 0,
                    lease_epoch: 0,
                },
                remote: "proxy".into(),
                rest: vec![],
            },
        );
    }

    /// A client logs in, on `gateway` or on the next live node (round robin, as the proxy
    /// picks).
    pub(super) fn stand_in_login(&mut self, c: usize, gateway: Option<NodeId>) {
        self.stand_in_login_with(c, gateway, None);
    }

    /// [`Self::login`], handed over from another geo with the handover's hint.
    pub(super) fn stand_in_login_with(
        &mut self,
        c: usize,
        gateway: Option<NodeId>,
        handover: Option<mesh::HandoverHint>,
    ) {
        let alive: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| n.alive && (self.s.gateways.is_empty() || self.s.gateways.contains(&n.id)))
            .map(|n| n.id)
            .collect();
        if alive.is_empty() {
            return;
        }
        let gateway = match gateway.filter(|g| alive.contains(g)) {
            Some(g) => g,
            None => {
                self.next_gateway += 1;
                alive[(self.next_gateway - 1) % alive.len()]
            }
        };
        let Some(link) = self.node(gateway).stand_in_link else {
            return;
        };
        let session_id = self.next_session;
        self.next_session += 1;
        self.session_client.insert(session_id, c);
        let inc = self.node(gateway).incarnation;
        let account = self.clients[c].account.clone();
        self.clients[c].begin(gateway, session_id);
        self.note(|| format!("{account} logs in on n{gateway} as session {session_id}"));
        // The proxy signs by the gateway's own clock: the sim's proxy has none. The key is the
        // built-in one every simulated sidecar's default config accepts.
        let key = cellmesh_proto::keys::KeyRing::parse(&[super::edge::ATTEST_KEY.to_string()], "")
            .expect("the built-in attest key parses");
        let attestation = cellmesh_proto::attest::sign(
            key.signing(),
            &account,
            session_id,
            self.time_of(gateway).unix_ms,
        );
        self.stand_in_sends(
            c,
            gateway,
            inc,
            link,
            mesh_message::Body::Attach(mesh::Attach {
                session_id,
                account,
                remote_addr: format!("client-{c}"),
                moved: false,
                moved_from_epoch: 0,
                handover,
                attestation,
            }),
        );
        let first = self.s.input_every_ms;
        self.schedule(
            first,
            Ev::StandInInput {
                client: c,
                session_id,
            },
        );
    }

    /// The proxy of `geo` dies (see [`Fault::ProxyRestart`]): its links close at once (the
    /// process is gone, its sockets with it), its clients' sessions are over, and a new proxy
    /// links to the geo's gateways `down_ms` later.
    pub(super) fn stand_in_proxy_restart(&mut self, geo: usize, down_ms: u64) {
        let clients: Vec<usize> = (0..self.clients.len())
            .filter(|&c| {
                let cl = &self.clients[c];
                !cl.ended && self.s.geo_of(cl.gateway) == geo
            })
            .collect();
        for &c in &clients {
            self.clients[c].ended = true;
        }
        self.note(|| {
            format!(
                "the proxy of {} dies; {} sessions with it",
                self.s.geo_label(geo),
                clients.len()
            )
        });
        for id in self.live_nodes_of(geo) {
            let Some(link) = self.node(id).stand_in_link.take() else {
                continue;
            };
            self.node(id).links.remove(&link);
            self.feed(
                id,
                Input::LinkClosed {
                    link,
                    reason: "connection reset".into(),
                },
            );
        }
        self.schedule(down_ms, Ev::StandInProxyBack { geo, clients });
    }

    pub(super) fn live_nodes_of(&self, geo: usize) -> Vec<NodeId> {
        (1..=self.s.nodes)
            .filter(|&n| self.s.geo_of(n) == geo && self.nodes[n as usize - 1].alive)
            .collect()
    }

    /// The new proxy of `geo` links to every live node of the geo, and the clients of the old one
    /// log in again over the next few hundred ms, each on any of its gateways.
    pub(super) fn stand_in_proxy_back(&mut self, geo: usize, clients: Vec<usize>) {
        let live = self.live_nodes_of(geo);
        // As at a node's start, the proxy links to every node; players attach to gateways.
        for &id in &live {
            if self.node(id).stand_in_link.is_none() {
                self.stand_in_link(id);
            }
        }
        let nodes: Vec<NodeId> = live
            .into_iter()
            .filter(|n| self.s.gateways.is_empty() || self.s.gateways.contains(n))
            .collect();
        if nodes.is_empty() {
            return;
        }
        for c in clients {
            // A client that logged in again meanwhile (a planned relogin) keeps that session.
            if !self.clients[c].ended {
                continue;
            }
            let gateway = nodes[self.rng.random_range(0..nodes.len())];
            let d = self.rng.random_range(0..400);
            self.schedule(d, Ev::StandInLoginOn { client: c, gateway });
        }
    }

    /// The client's proxy hands its session over to another geo (see [`Fault::Handover`]).
    pub(super) fn stand_in_hand_over(&mut self, c: usize) {
        let Some(cl) = self.clients.get(c) else {
            return;
        };
        let (Some(epoch), false) = (cl.epoch, cl.ended) else {
            return;
        };
        let (from, session_id) = (cl.gateway, cl.session_id);
        let from_geo = self.s.geo_of(from);
        let home = self.s.client_geo(c);
        let mut targets: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| n.alive && n.stand_in_link.is_some() && self.s.geo_of(n.id) != from_geo)
            .filter(|n| self.s.gateways.is_empty() || self.s.gateways.contains(&n.id))
            .map(|n| n.id)
            .collect();
        if targets.is_empty() {
            return;
        }
        // The client's own geo if it played elsewhere; any other geo otherwise.
        targets.sort_by_key(|&n| (self.s.geo_of(n) != home, n));
        let to = targets[0];
        if let Some(link) = self.node(from).stand_in_link {
            let inc = self.node(from).incarnation;
            self.stand_in_sends(
                c,
                from,
                inc,
                link,
                mesh_message::Body::Detach(mesh::Detach {
                    session_id,
                    kick_reason: cellmesh_proto::edge::KickReason::Transferred as u32,
                    detail: format!("handed over to geo {}", self.s.geo_name(to)),
                    retry_after_ms: 0,
                }),
            );
        }
        let account = self.clients[c].account.clone();
        self.note(|| {
            format!(
                "{account}'s session {session_id} on n{from} is handed over to n{to} ({})",
                self.s.geo_name(to)
            )
        });
        // The session here is over; the client reconnects there after a round trip and a bit.
        self.clients[c].ended = true;
        self.clients[c].keep_avatar = self.clients[c].avatar;
        let rtt = 2 * self.s.client_delay_of(c, to).base_ms;
        self.schedule(
            rtt + 50,
            Ev::StandInHandedOver {
                client: c,
                gateway: to,
                session_epoch: epoch,
            },
        );
    }

    /// A message from client `c` reaches its gateway through the proxy's link, in order.
    pub(super) fn stand_in_sends(
        &mut self,
        c: usize,
        gateway: NodeId,
        inc: u32,
        link: LinkId,
        body: mesh_message::Body,
    ) {
        let d = self.s.client_delay_of(c, gateway).draw(&mut self.rng);
        let at = self.fifo(Stream::FromClient(c), d);
        self.schedule_at(
            at,
            Ev::Core {
                node: gateway,
                inc,
                input: Input::LinkFrame {
                    link,
                    messages: vec![MeshMessage::from(body)],
                },
            },
        );
    }

    pub(super) fn stand_in_receives(&mut self, gateway: NodeId, frame: MeshFrame) {
        for m in frame.messages {
            let Some(body) = m.body else { continue };
            let session_id = match &body {
                mesh_message::Body::ToClient(t) => t.session_id,
                mesh_message::Body::Attached(a) => a.session_id,
                mesh_message::Body::Detach(d) => d.session_id,
                _ => continue,
            };
            let Some(client) = self
                .clients
                .iter()
                .position(|c| c.gateway == gateway && c.session_id == session_id)
            else {
                continue;
            };
            let d = self.s.client_delay_of(client, gateway).draw(&mut self.rng);
            let at = self.fifo(Stream::ToClient(client), d);
            self.schedule_at(
                at,
                Ev::StandInToClient {
                    client,
                    session_id,
                    body,
                },
            );
        }
    }

    pub(super) fn stand_in_client_receives(
        &mut self,
        c: usize,
        session_id: u64,
        body: mesh_message::Body,
    ) {
        if self.clients[c].session_id != session_id || self.clients[c].ended {
            return;
        }
        match body {
            mesh_message::Body::Attached(a) => self.clients[c].epoch = Some(a.session_epoch),
            mesh_message::Body::Detach(d) => {
                let account = self.clients[c].account.clone();
                self.note(|| format!("{account} detached: {}", d.detail));
                self.clients[c].ended = true;
            }
            mesh_message::Body::ToClient(t) => self.client_views(c, &t.server_frame),
            _ => {}
        }
    }

    pub(super) fn stand_in_input(&mut self, c: usize, session_id: u64) {
        if self.clients[c].session_id != session_id || self.clients[c].ended {
            return;
        }
        if self.now + INPUTS_STOP_BEFORE_END_MS > self.s.motion_ms + self.s.settle_ms {
            // The last inputs must land before the final count.
            return;
        }
        let gateway = self.clients[c].gateway;
        let world = self.world;
        let now = self.now;
        if let Some((seq, payload)) = self.clients[c].next_input(now, &world, &mut self.rng) {
            let link = self.node(gateway).stand_in_link;
            if let (Some(link), true) = (link, self.node(gateway).alive) {
                let inc = self.node(gateway).incarnation;
                let account = self.clients[c].account.clone();
                let epoch = self.clients[c].epoch.unwrap_or(0);
                self.check.input_sent(&account, epoch, seq);
                self.stats.inputs_sent += 1;
                self.stand_in_sends(
                    c,
                    gateway,
                    inc,
                    link,
                    mesh_message::Body::Input(mesh::SessionInput {
                        session_id,
                        seq,
                        payload,
                    }),
                );
            }
        }
        let every = self.s.input_every_ms;
        self.schedule(
            every,
            Ev::StandInInput {
                client: c,
                session_id,
            },
        );
    }
}
