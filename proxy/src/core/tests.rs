//! The proxy's core driven by hand, input by input, in virtual time: logins, relays, moves,
//! refusals, timeouts, drains. The harness is here; the modules below hold the tests by subject.

mod admission;
mod drains;
mod fallbacks;
mod logins;
mod sessions;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::edge::{
    client_message, server_message, ClientFrame, ClientInput, ClientMessage, KickReason, Pong,
    ServerFrame,
};
use cellmesh_proto::mesh::{mesh_message::Body, Admission, Attached, MeshMessage, ToClient};
use prost::Message;

use super::*;
use crate::config::ProxyConfig;

/// The wall clock of every test: 2027, well inside any token's life.
const UNIX_MS: u64 = 1_800_000_000_000;

struct Harness {
    core: ProxyCore,
    cfg: ProxyConfig,
    /// The registry the core's metrics are in: what `/metrics` would show.
    registry: prometheus_client::registry::Registry,
    now: Duration,
    outputs: Vec<Output>,
}

impl Harness {
    fn new(gateways: usize, tweak: impl FnOnce(&mut ProxyConfig)) -> Self {
        let mut cfg = ProxyConfig {
            gateways: (0..gateways)
                .map(|g| format!("10.0.0.{}:7200", g + 1))
                .collect(),
            ..ProxyConfig::default()
        };
        tweak(&mut cfg);
        let rings = cfg.rings().expect("rings");
        let (metrics, registry) = crate::metrics::Metrics::new();
        let core = ProxyCore::new(Arc::new(cfg.clone()), rings, Arc::new(metrics), 7);
        let mut h = Self {
            core,
            cfg,
            registry,
            now: Duration::ZERO,
            outputs: Vec::new(),
        };
        h.drain_outputs();
        h
    }

    fn now(&self) -> Now {
        Now {
            mono: self.now,
            unix_ms: UNIX_MS + self.now.as_millis() as u64,
        }
    }

    fn feed(&mut self, input: Input) {
        let now = self.now();
        self.core.handle(now, input);
        self.drain_outputs();
    }

    fn drain_outputs(&mut self) {
        while let Some(o) = self.core.poll_output() {
            self.outputs.push(o);
        }
    }

    /// Moves the clock on by `ms`, firing every timer due on the way, in order.
    fn advance(&mut self, ms: u64) {
        let end = self.now + Duration::from_millis(ms);
        while let Some(due) = self.core.poll_timeout() {
            let due = Duration::from_millis(due);
            if due > end {
                break;
            }
            self.now = self.now.max(due);
            self.feed(Input::Timer);
        }
        self.now = end;
    }

    fn take(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    fn link_up(&mut self, g: GatewayId, node_id: u32) {
        self.feed(Input::LinkUp {
            gateway: g,
            node_id,
        });
    }

    fn gateway_says(&mut self, g: GatewayId, body: Body) {
        self.feed(Input::LinkMessage {
            gateway: g,
            message: MeshMessage { body: Some(body) },
        });
    }

    fn client_sends(&mut self, conn: ConnId, bodies: Vec<client_message::Body>) {
        let frame = ClientFrame {
            messages: bodies
                .into_iter()
                .map(|b| ClientMessage { body: Some(b) })
                .collect(),
        };
        self.feed(Input::ClientFrame {
            conn,
            frame,
            kernel_rtt: None,
        });
    }

    /// Opens connection `conn`; returns its challenge.
    fn open(&mut self, conn: ConnId) -> Vec<u8> {
        self.feed(Input::ClientOpened {
            conn,
            peer: format!("192.0.2.{conn}:5000").parse().unwrap(),
        });
        match &self.server_bodies(conn)[..] {
            [server_message::Body::Challenge(c)] => c.nonce.to_vec(),
            other => panic!("expected the challenge, got {other:?}"),
        }
    }

    /// `account`'s hello with a valid token, proved over the challenge `nonce`.
    fn hello(&self, account: &str, nonce: &[u8]) -> client_message::Body {
        hello_with(&self.token(account), nonce)
    }

    /// A token for `account` signed with the configured secret, valid for an hour.
    fn token(&self, account: &str) -> String {
        let expiry = UNIX_MS / 1000 + 3600;
        cellmesh_proto::token::sign(self.cfg.token_secret.as_bytes(), account, expiry)
    }

    /// The `/metrics` page of the core's counters.
    fn metrics_text(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }

    /// The gateway answers `session`'s attach with `epoch`: the client is welcomed.
    fn gateway_attaches(&mut self, g: GatewayId, session: u64, epoch: u64) {
        self.gateway_says(
            g,
            Body::Attached(Attached {
                session_id: session,
                session_epoch: epoch,
                gateway_node: g as u32 + 1,
                world_width: 4096.0,
                world_height: 4096.0,
                chunk_size: 32.0,
            }),
        );
    }

    /// The `Welcome` queued for `conn` (its other messages are dropped).
    fn welcome(&mut self, conn: ConnId) -> cellmesh_proto::edge::Welcome {
        let bodies = self.server_bodies(conn);
        bodies
            .into_iter()
            .find_map(|b| match b {
                server_message::Body::Welcome(w) => Some(w),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no Welcome for {conn}; outputs {:?}", self.outputs))
    }

    /// The sessions' inputs sent to gateways since the last take: (gateway, session, seq).
    fn inputs_sent(&mut self) -> Vec<(GatewayId, u64, u64)> {
        self.sent_to_gateways()
            .into_iter()
            .filter_map(|(g, m, _)| match m {
                Body::Input(i) => Some((g, i.session_id, i.seq)),
                _ => None,
            })
            .collect()
    }

    /// Opens connection `conn` and logs `account` in with a valid token; returns the session id
    /// the gateway is asked to attach, and its gateway.
    fn login(&mut self, conn: ConnId, account: &str) -> (GatewayId, u64) {
        let nonce = self.open(conn);
        let hello = self.hello(account, &nonce);
        self.client_sends(conn, vec![hello]);
        let attach = self
            .sent_to_gateways()
            .into_iter()
            .find_map(|(g, m, _)| match m {
                Body::Attach(a) => Some((g, a)),
                _ => None,
            });
        let (g, a) = attach.unwrap_or_else(|| panic!("no Attach: {:?}", self.outputs));
        assert_eq!(a.account, account);
        assert!(
            !a.attestation.is_empty(),
            "every attach carries an attestation"
        );
        (g, a.session_id)
    }

    /// Logs in and attaches: the session is relayed.
    fn attached(&mut self, conn: ConnId, account: &str, epoch: u64) -> (GatewayId, u64) {
        let (g, session) = self.login(conn, account);
        self.gateway_attaches(g, session, epoch);
        match &self.server_bodies(conn)[..] {
            [server_message::Body::Welcome(w), ..] => {
                assert_eq!((w.account.as_str(), w.session_epoch), (account, epoch))
            }
            other => panic!("expected Welcome, got {other:?}"),
        }
        (g, session)
    }

    /// The server messages queued for `conn` since the last take (the others are kept).
    fn server_bodies(&mut self, conn: ConnId) -> Vec<server_message::Body> {
        let mut bodies = Vec::new();
        self.outputs.retain(|o| match o {
            Output::ToClient { conn: c, frames } if *c == conn => {
                for f in frames {
                    bodies.extend(decode(f));
                }
                false
            }
            _ => true,
        });
        bodies
    }

    /// The messages queued for gateways since the last take (the others are kept).
    fn sent_to_gateways(&mut self) -> Vec<(GatewayId, Body, bool)> {
        let mut sent = Vec::new();
        self.outputs.retain(|o| match o {
            Output::ToLink {
                gateway,
                message,
                data,
            } => {
                sent.push((*gateway, message.body.clone().expect("a body"), *data));
                false
            }
            _ => true,
        });
        sent
    }

    /// What the core said for the log since the last take.
    fn events(&self) -> Vec<&Event> {
        self.outputs
            .iter()
            .filter_map(|o| match o {
                Output::Event(e) => Some(e),
                _ => None,
            })
            .collect()
    }

    /// The last frame `conn` was closed with, if it was closed.
    fn closed_with(&mut self, conn: ConnId) -> Option<Option<server_message::Body>> {
        let at = self
            .outputs
            .iter()
            .position(|o| matches!(o, Output::CloseClient { conn: c, .. } if *c == conn))?;
        let Output::CloseClient { last, .. } = self.outputs.remove(at) else {
            unreachable!()
        };
        Some(last.map(|b| decode(&b).into_iter().next().expect("one message")))
    }

    fn kicked(&mut self, conn: ConnId) -> (KickReason, String) {
        match self.closed_with(conn) {
            Some(Some(server_message::Body::Kick(k))) => {
                (KickReason::try_from(k.reason).unwrap(), k.detail)
            }
            other => panic!(
                "expected a kick for {conn}, got {other:?}; outputs {:?}",
                self.outputs
            ),
        }
    }
}

/// A hello carrying `token`, proved over the challenge `nonce`.
fn hello_with(token: &str, nonce: &[u8]) -> client_message::Body {
    let hello = cellmesh_proto::client::login_hello(token, nonce).unwrap();
    client_message::Body::Hello(Box::new(hello))
}

fn decode(frame: &Bytes) -> Vec<server_message::Body> {
    ServerFrame::decode(frame.clone())
        .expect("a ServerFrame")
        .messages
        .into_iter()
        .filter_map(|m| m.body)
        .collect()
}

fn input(seq: u64) -> client_message::Body {
    client_message::Body::Input(ClientInput {
        seq,
        payload: vec![seq as u8].into(),
    })
}

#[test]
fn a_login_is_challenged_attached_welcomed_and_relayed_both_ways() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    assert!(h.take().iter().any(|o| matches!(o, Output::Ready(true))));
    let (g, session) = h.attached(1, "alice", 5);
    h.client_sends(1, vec![input(1), input(2)]);
    let sent: Vec<(u64, bool)> = h
        .sent_to_gateways()
        .into_iter()
        .filter_map(|(to, m, data)| match m {
            Body::Input(i) if to == g && i.session_id == session => Some((i.seq, data)),
            _ => None,
        })
        .collect();
    assert_eq!(sent, [(1, true), (2, true)], "inputs go as data, in order");
    let update = Bytes::from_static(b"an encoded server frame");
    h.gateway_says(
        g,
        Body::ToClient(ToClient {
            session_id: session,
            server_frame: update.clone(),
        }),
    );
    let relayed: Vec<Bytes> = h
        .take()
        .into_iter()
        .filter_map(|o| match o {
            Output::ToClient { conn: 1, frames } => Some(frames),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(
        relayed,
        [update],
        "the gateway's frames go to the client untouched"
    );
    assert_eq!(h.core.sessions_json().len(), 1);
}

#[test]
fn a_client_without_a_hello_is_kicked_at_the_deadline_and_not_before() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.feed(Input::ClientOpened {
        conn: 1,
        peer: "192.0.2.1:5000".parse().unwrap(),
    });
    h.advance(h.cfg.hello_timeout_ms - 1);
    assert!(h.closed_with(1).is_none());
    h.advance(1);
    assert_eq!(h.kicked(1).0, KickReason::HelloTimeout);
    assert_eq!(h.core.connections(), 0);
}

/// Two gateways up, alice attached at epoch 9, then her gateway's link breaks.
fn alice_attached_then_her_link_lost() -> (Harness, GatewayId) {
    let mut h = Harness::new(2, |_| {});
    h.link_up(0, 1);
    h.link_up(1, 2);
    let (g, _) = h.attached(1, "alice", 9);
    h.take();
    h.feed(Input::LinkDown {
        gateway: g,
        error: Some("gateway silent for 5 s".into()),
    });
    (h, g)
}

#[test]
fn a_broken_link_moves_the_session_to_another_gateway_with_its_epoch() {
    let (mut h, g) = alice_attached_then_her_link_lost();
    let attach = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(to, m, _)| match m {
            Body::Attach(a) => Some((to, a)),
            _ => None,
        });
    let (to, a) = attach.expect("attached elsewhere at once");
    assert_ne!(to, g);
    assert!(a.moved);
    assert_eq!(a.moved_from_epoch, 9);
    assert!(h.closed_with(1).is_none(), "the client stays connected");
    assert_eq!(h.core.metrics().sessions_moved.get(), 1);
}

#[test]
fn a_lost_link_is_logged_with_its_sessions_and_each_move() {
    let (h, g) = alice_attached_then_her_link_lost();
    let events = h.events();
    let lost = events
        .iter()
        .position(|e| {
            matches!(e, Event::LinkLost { gateway, sessions: 1, error }
                if *gateway == format!("10.0.0.{}:7200", g + 1) && error == "gateway silent for 5 s")
        })
        .unwrap_or_else(|| panic!("no link lost in {events:?}"));
    let moving = events
        .iter()
        .position(|e| matches!(e, Event::SessionMoving { account, .. } if &**account == "alice"))
        .unwrap_or_else(|| panic!("no move in {events:?}"));
    assert!(
        lost < moving,
        "the loss is said before the move: {events:?}"
    );
    // A link closed on purpose (no error) is not logged as lost.
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.take();
    h.feed(Input::LinkDown {
        gateway: 0,
        error: None,
    });
    assert!(!h
        .events()
        .iter()
        .any(|e| matches!(e, Event::LinkLost { .. })));
}

#[test]
fn with_no_gateway_up_a_move_waits_for_one_until_the_deadline() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.attached(1, "alice", 3);
    h.attached(2, "bob", 4);
    h.take();
    h.feed(Input::LinkDown {
        gateway: 0,
        error: Some("gateway closed the link".into()),
    });
    assert!(h.sent_to_gateways().is_empty(), "nowhere to go yet");
    h.advance(h.cfg.hello_timeout_ms / 2);
    // alice's client is still there when the link comes back: both move to it.
    h.link_up(0, 1);
    let moved: Vec<String> = h
        .sent_to_gateways()
        .into_iter()
        .filter_map(|(_, m, _)| match m {
            Body::Attach(a) if a.moved => Some(a.account),
            _ => None,
        })
        .collect();
    assert_eq!(moved.len(), 2, "{moved:?}");
    // Down again, for good: the wait ends in a kick.
    h.feed(Input::LinkDown {
        gateway: 0,
        error: Some("gateway closed the link".into()),
    });
    h.advance(h.cfg.hello_timeout_ms);
    let (reason, detail) = h.kicked(1);
    assert_eq!(reason, KickReason::GatewayUnavailable);
    assert!(detail.contains("no other gateway link is up"), "{detail}");
}

#[test]
fn when_every_gateway_admits_no_one_a_login_is_refused_with_a_retry_after() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.gateway_says(
        0,
        Body::Admission(Admission {
            open: false,
            reason: "tick_overrun".into(),
            retry_after_ms: 4000,
        }),
    );
    h.take();
    let nonce = h.open(1);
    let hello = h.hello("alice", &nonce);
    h.client_sends(1, vec![hello]);
    match h.closed_with(1) {
        Some(Some(server_message::Body::Kick(k))) => {
            assert_eq!(k.reason, KickReason::ServerFull as i32);
            assert_eq!(k.retry_after_ms, 4000);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.core.metrics().logins_refused_server_full.get(), 1);
}

#[test]
fn a_replayed_hello_is_refused_on_another_connection() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let nonce = h.open(1);
    let hello = h.hello("alice", &nonce);
    h.open(2);
    h.client_sends(2, vec![hello]);
    assert_eq!(h.kicked(2).0, KickReason::BadToken);
}

#[test]
fn pings_time_the_client_and_its_figure_goes_to_the_gateway() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let (g, session) = h.attached(1, "alice", 1);
    h.take();
    h.advance(h.cfg.ping_interval_ms);
    let nonce = match &h.server_bodies(1)[..] {
        [server_message::Body::Ping(p)] => p.nonce,
        other => panic!("expected one ping, got {other:?}"),
    };
    h.now += Duration::from_millis(40);
    h.client_sends(1, vec![client_message::Body::Pong(Pong { nonce })]);
    let rtt = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(to, m, data)| match m {
            Body::Rtt(r) if to == g => Some((r, data)),
            _ => None,
        });
    let (rtt, data) = rtt.expect("an RTT report");
    assert_eq!(rtt.session_id, session);
    assert_eq!(rtt.rtt_ms_p50, 40.0);
    assert!(data, "advisory: dropped first when the link is busy");
}

#[test]
fn a_silent_client_is_kicked_idle_and_its_gateway_told() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let (g, session) = h.attached(1, "alice", 1);
    h.take();
    h.advance(h.cfg.idle_timeout_ms + h.cfg.idle_timeout_ms / 4);
    assert_eq!(h.kicked(1).0, KickReason::Idle);
    let detached = h.sent_to_gateways().into_iter().any(|(to, m, data)| {
        matches!(m, Body::Detach(d) if to == g && d.session_id == session && d.kick_reason == KickReason::Idle as u32)
            && !data
    });
    assert!(
        detached,
        "the gateway hears the session is gone, as control"
    );
}

#[test]
fn a_client_that_stops_reading_is_kicked_alone() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.attached(1, "alice", 1);
    h.attached(2, "bob", 2);
    h.take();
    h.feed(Input::ClientStalled { conn: 1 });
    assert_eq!(h.kicked(1).0, KickReason::SlowConsumer);
    assert!(h.closed_with(2).is_none());
    assert_eq!(h.core.sessions_json().len(), 1);
}

#[test]
fn a_flood_over_the_rate_limit_is_kicked() {
    let mut h = Harness::new(1, |cfg| {
        cfg.rate.account_inputs_per_sec = 10;
        cfg.rate.account_burst = 10;
        cfg.rate.flood_kick_drops = 5;
    });
    h.link_up(0, 1);
    h.attached(1, "alice", 1);
    h.take();
    h.client_sends(1, (0..20).map(input).collect());
    assert_eq!(h.kicked(1).0, KickReason::Flood);
    let relayed = h
        .sent_to_gateways()
        .into_iter()
        .filter(|(_, m, _)| matches!(m, Body::Input(_)))
        .count();
    assert_eq!(
        relayed, 10,
        "the burst passes, the rest is dropped until the kick"
    );
}

#[test]
fn a_drain_serves_through_the_grace_then_asks_everyone_to_reconnect_and_stops() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    for conn in 1..=4 {
        h.attached(conn, &format!("p{conn}"), conn);
    }
    h.take();
    h.feed(Input::Drain);
    assert!(h.take().iter().any(|o| matches!(o, Output::Ready(false))));
    h.advance(h.cfg.drain_grace_ms - 1);
    assert!(
        h.outputs.is_empty()
            || !h
                .outputs
                .iter()
                .any(|o| matches!(o, Output::CloseClient { .. }))
    );
    h.advance(1);
    assert!(h.outputs.iter().any(|o| matches!(o, Output::StopAccepting)));
    h.advance(h.cfg.drain_spread_ms);
    for conn in 1..=4 {
        assert_eq!(h.kicked(conn).0, KickReason::Reconnect);
    }
    assert!(h.outputs.iter().any(|o| matches!(o, Output::Stopped)));
}

#[test]
fn timers_are_armed_only_for_what_is_under_way() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let housekeeping = h.core.timers.armed();
    h.attached(1, "alice", 1);
    // The session's ping and idleness check.
    assert_eq!(h.core.timers.armed(), housekeeping + 2);
    h.client_sends(1, vec![client_message::Body::Bye(Default::default())]);
    assert_eq!(
        h.closed_with(1),
        Some(None),
        "a client that left gets no last word"
    );
    assert_eq!(h.core.timers.armed(), housekeeping);
}

#[test]
fn a_login_says_what_its_span_records_and_the_driver_times_it() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.take();
    h.attached(1, "alice", 7);
    let outputs = h.take();
    assert!(outputs
        .iter()
        .any(|o| matches!(o, Output::LoginStarted { conn: 1 })));
    let ended: Vec<&LoginTrace> = outputs
        .iter()
        .filter_map(|o| match o {
            Output::LoginEnded { conn: 1, trace } => Some(trace),
            _ => None,
        })
        .collect();
    assert_eq!(
        ended,
        [&LoginTrace {
            account: "alice".into(),
            handover: None,
            gateway: Some("10.0.0.1:7200".into()),
            node: Some(1),
            session_epoch: Some(7),
            outcome: "attached",
            reason: None,
        }]
    );
    // A refused login ends its span with the reason.
    let nonce = h.open(2);
    let hello = h.hello("bob", &nonce);
    h.open(3);
    h.client_sends(3, vec![hello]);
    let refused = h.take().into_iter().find_map(|o| match o {
        Output::LoginEnded { conn: 3, trace } => Some(trace),
        _ => None,
    });
    let refused = refused.expect("the refused login's end");
    assert_eq!(
        (refused.outcome, refused.reason),
        ("refused", Some("BAD_TOKEN"))
    );
}
