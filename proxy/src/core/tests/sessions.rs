//! A session's life past its welcome: displacement, idleness, pings and RTT, a bye, moves when
//! a gateway link breaks, and the pick of a gateway.

use cellmesh_proto::edge::{CookieResponse, Ping};
use cellmesh_proto::mesh::{Detach, SessionRtt, SessionWhere};

use crate::config::PeerGeo;

use super::*;

#[test]
fn a_login_elsewhere_ends_the_older_session_as_its_gateway_says_and_no_detach_goes_back() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let (g, first) = h.attached(1, "alice", 1);
    let (_, second) = h.login(2, "alice");
    assert!(second > first, "session ids only grow");
    h.gateway_attaches(g, second, 2);
    assert_eq!(h.welcome(2).session_epoch, 2);
    // The gateway displaces the older session of the account itself.
    h.gateway_says(
        g,
        Body::Detach(Detach {
            session_id: first,
            kick_reason: KickReason::Displaced as u32,
            detail: "account logged in elsewhere".into(),
            retry_after_ms: 0,
        }),
    );
    assert_eq!(
        h.kicked(1),
        (KickReason::Displaced, "account logged in elsewhere".into())
    );
    let detached_back = h
        .sent_to_gateways()
        .into_iter()
        .any(|(_, m, _)| matches!(m, Body::Detach(d) if d.session_id == first));
    assert!(!detached_back, "the gateway ended that session itself");
    h.client_sends(2, vec![input(1)]);
    assert_eq!(h.inputs_sent(), [(g, second, 1)]);
    assert_eq!(h.core.sessions_json().len(), 1);
}

#[test]
fn a_silent_client_is_kicked_idle_while_a_talking_neighbour_is_left_alone() {
    let mut h = Harness::new(1, |cfg| {
        cfg.idle_timeout_ms = 400;
        cfg.ping_interval_ms = 60_000;
    });
    h.link_up(0, 1);
    let (g, sleepy) = h.attached(1, "sleepy", 1);
    h.attached(2, "busy", 2);
    h.take();
    for seq in 0..8 {
        h.client_sends(2, vec![input(seq)]);
        h.advance(100);
    }
    assert_eq!(
        h.kicked(1),
        (KickReason::Idle, "no message for 400 ms".into())
    );
    assert!(h.closed_with(2).is_none(), "the talking neighbour stays");
    let detached = h.sent_to_gateways().into_iter().any(|(to, m, _)| {
        matches!(m, Body::Detach(d) if to == g && d.session_id == sleepy && d.kick_reason == KickReason::Idle as u32)
    });
    assert!(detached, "the gateway hears the idle session is gone");
    h.client_sends(2, vec![input(100)]);
    assert_eq!(h.inputs_sent().len(), 1, "the neighbour still relays");
}

#[test]
fn a_clients_ping_is_answered_and_the_proxys_own_pings_make_its_rtt_figures() {
    let mut h = Harness::new(1, |cfg| cfg.ping_interval_ms = 30);
    h.link_up(0, 1);
    let (g, session) = h.attached(1, "pinger", 1);
    h.take();
    h.client_sends(1, vec![client_message::Body::Ping(Ping { nonce: 4242 })]);
    match &h.server_bodies(1)[..] {
        [server_message::Body::Pong(p)] => assert_eq!(p.nonce, 4242),
        other => panic!("expected a Pong, got {other:?}"),
    }
    let mut reports = Vec::new();
    for delay in [20, 40, 30] {
        h.advance(h.cfg.ping_interval_ms);
        let nonce = h
            .server_bodies(1)
            .into_iter()
            .find_map(|b| match b {
                server_message::Body::Ping(p) => Some(p.nonce),
                _ => None,
            })
            .expect("the proxy pings");
        h.now += Duration::from_millis(delay);
        h.client_sends(1, vec![client_message::Body::Pong(Pong { nonce })]);
        reports.extend(
            h.sent_to_gateways()
                .into_iter()
                .filter_map(|(to, m, _)| match m {
                    Body::Rtt(r) if to == g && r.session_id == session => Some(r),
                    _ => None,
                }),
        );
    }
    assert_eq!(reports.len(), 3, "{reports:?}");
    let last = reports.last().unwrap();
    assert_eq!(last.rtt_ms_min, 20.0, "{last:?}");
    assert!(last.rtt_ms_min <= last.rtt_ms_p50, "{last:?}");
    let stats = h.core.metrics().stats();
    assert_eq!(stats.rtt_samples, 3, "{stats:?}");
    assert!(
        stats.rtt_ms_p50 > 0.0 && stats.rtt_ms_p99 >= stats.rtt_ms_p50,
        "{stats:?}"
    );
    let state = &h.core.sessions_json()[0];
    assert_eq!(state["account"], "pinger");
    assert!(state["rtt_ms_p50"].as_f64().unwrap() > 0.0, "{state}");
    assert_eq!(state["rtt_ms_min"].as_f64().unwrap(), 20.0, "{state}");
}

/// The next ping of `conn`'s session, answered: the `SessionRtt` its gateway `g` gets.
fn next_rtt_report(h: &mut Harness, conn: ConnId, g: GatewayId) -> SessionRtt {
    h.advance(h.cfg.ping_interval_ms);
    let nonce = h
        .server_bodies(conn)
        .into_iter()
        .find_map(|b| match b {
            server_message::Body::Ping(p) => Some(p.nonce),
            _ => None,
        })
        .expect("the proxy pings");
    h.now += Duration::from_millis(40);
    h.client_sends(conn, vec![client_message::Body::Pong(Pong { nonce })]);
    let mut reports: Vec<SessionRtt> = h
        .sent_to_gateways()
        .into_iter()
        .filter_map(|(to, m, _)| match m {
            Body::Rtt(r) if to == g => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(reports.len(), 1, "{reports:?}");
    reports.remove(0)
}

/// Whether the handover policy asked the board what other geos measured to `account`.
fn asked_far_rtts(h: &mut Harness, account: &str) -> bool {
    let before = h.outputs.len();
    let asked = |o: &Output| {
        matches!(o, Output::Board { request: BoardRequest::FarRtts { account: a }, .. }
            if a == account)
    };
    h.outputs.retain(|o| !asked(o));
    h.outputs.len() < before
}

#[test]
fn what_other_geos_proxies_measured_goes_to_the_gateway_with_the_next_rtt_report() {
    let mut h = Harness::new(1, |cfg| {
        cfg.geo = "paris".into();
        cfg.geos.peers = ["hongkong", "montreal"]
            .map(|name| PeerGeo {
                name: name.into(),
                proxies: format!("{name}.example:7100"),
                board: "memory".into(),
            })
            .to_vec();
    });
    h.link_up(0, 1);
    // A login of a network of several geos: no hint on the board, no cookie with the client.
    let nonce = h.open(1);
    let hello = h.hello("alice", &nonce);
    h.client_sends(1, vec![hello]);
    h.feed(Input::Board {
        conn: 1,
        reply: BoardReply::Hint(None),
    });
    h.client_sends(
        1,
        vec![client_message::Body::Cookie(CookieResponse::default())],
    );
    let (g, session) = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(to, m, _)| match m {
            Body::Attach(a) => Some((to, a.session_id)),
            _ => None,
        })
        .expect("attached without a hint");
    h.gateway_attaches(g, session, 1);
    assert_eq!(h.welcome(1).account, "alice");
    // Simulated in Montreal: the policy asks the board for the far figures every tick.
    h.gateway_says(
        g,
        Body::Where(SessionWhere {
            session_id: session,
            geo: "montreal".into(),
            region: 3,
            position: None,
        }),
    );
    let first = next_rtt_report(&mut h, 1, g);
    assert!(first.far.is_empty(), "nothing measured afar yet: {first:?}");
    assert!(asked_far_rtts(&mut h, "alice"));
    let figure = |min_ms: f64, median_ms: f64| RttFigure {
        min_ms,
        median_ms,
        samples: 5,
    };
    h.feed(Input::Board {
        conn: 1,
        reply: BoardReply::FarRtts(HashMap::from([
            ("montreal".to_string(), figure(12.0, 15.0)),
            ("hongkong".to_string(), figure(180.0, 190.0)),
        ])),
    });
    let far: Vec<(String, f32, f32)> = next_rtt_report(&mut h, 1, g)
        .far
        .into_iter()
        .map(|f| (f.geo, f.rtt_ms_p50, f.rtt_ms_min))
        .collect();
    assert_eq!(
        far,
        [
            ("hongkong".to_string(), 190.0, 180.0),
            ("montreal".to_string(), 15.0, 12.0),
        ],
        "by geo, each with its median and minimum"
    );
    // The board's next answer replaces them whole: Hong Kong's figure expired there.
    h.feed(Input::Board {
        conn: 1,
        reply: BoardReply::FarRtts(HashMap::from([(
            "montreal".to_string(),
            figure(11.0, 14.0),
        )])),
    });
    let far: Vec<(String, f32, f32)> = next_rtt_report(&mut h, 1, g)
        .far
        .into_iter()
        .map(|f| (f.geo, f.rtt_ms_p50, f.rtt_ms_min))
        .collect();
    assert_eq!(far, [("montreal".to_string(), 14.0, 11.0)]);
}

#[test]
fn a_bye_detaches_the_session_at_its_gateway_and_leaves_the_neighbour() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.attached(1, "neighbour", 1);
    let (g, leaver) = h.attached(2, "leaver", 2);
    h.take();
    h.client_sends(2, vec![client_message::Body::Bye(Default::default())]);
    assert_eq!(h.closed_with(2), Some(None));
    let detaches: Vec<(GatewayId, Detach, bool)> = h
        .sent_to_gateways()
        .into_iter()
        .filter_map(|(to, m, data)| match m {
            Body::Detach(d) => Some((to, d, data)),
            _ => None,
        })
        .collect();
    assert_eq!(detaches.len(), 1, "{detaches:?}");
    let (to, d, data) = &detaches[0];
    assert_eq!((*to, d.session_id, d.kick_reason), (g, leaver, 0));
    assert_eq!(d.detail, "bye");
    assert!(!data, "a detach is control");
    assert!(h.closed_with(1).is_none());
    assert_eq!(h.core.sessions_json().len(), 1);
    assert_eq!(h.core.metrics().stats().sessions, 1);
}

#[test]
fn a_moved_session_is_welcomed_by_its_new_gateway_and_relays_there() {
    let mut h = Harness::new(2, |_| {});
    h.link_up(0, 1);
    h.link_up(1, 2);
    let (lost, _) = h.attached(1, "alice", 4);
    h.client_sends(1, vec![input(1)]);
    h.take();
    h.feed(Input::LinkDown {
        gateway: lost,
        error: Some("gateway closed the link".into()),
    });
    let (other, session) = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(to, m, _)| match m {
            Body::Attach(a) if a.account == "alice" && a.moved => Some((to, a.session_id)),
            _ => None,
        })
        .expect("attached at the other gateway");
    assert_ne!(other, lost);
    h.gateway_attaches(other, session, 5);
    let moved = h.welcome(1);
    assert_eq!(
        (moved.account.as_str(), moved.gateway_node, moved.session_id),
        ("alice", other as u32 + 1, session),
        "welcomed again on the same connection by the gateway whose link is up"
    );
    h.client_sends(1, vec![input(2)]);
    assert_eq!(h.inputs_sent(), [(other, session, 2)]);
    assert!(h
        .metrics_text()
        .contains("cellmesh_proxy_sessions_moved_total 1"));
}

#[test]
fn a_lone_gateway_whose_link_comes_back_gets_the_session_under_a_new_id() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let (g, first) = h.attached(1, "alice", 1);
    h.take();
    h.feed(Input::LinkDown {
        gateway: g,
        error: Some("gateway closed the link".into()),
    });
    assert!(h.take().iter().any(|o| matches!(o, Output::Ready(false))));
    h.advance(50);
    h.link_up(g, 1);
    assert!(h.outputs.iter().any(|o| matches!(o, Output::Ready(true))));
    let moved = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(_, m, _)| match m {
            Body::Attach(a) if a.moved => Some(a),
            _ => None,
        })
        .expect("attached again once the link is back");
    assert!(
        moved.session_id > first,
        "session ids are never reused on a link"
    );
    assert_eq!(moved.moved_from_epoch, 1);
    h.gateway_attaches(g, moved.session_id, 2);
    assert_eq!(h.welcome(1).session_id, moved.session_id);
    h.client_sends(1, vec![input(2)]);
    assert_eq!(h.inputs_sent(), [(g, moved.session_id, 2)]);
}

#[test]
fn logins_are_spread_round_robin_over_the_gateways_up() {
    let mut h = Harness::new(2, |_| {});
    h.link_up(0, 1);
    h.link_up(1, 2);
    let mut per_gateway = HashMap::new();
    for conn in 1..=4 {
        let (g, _) = h.attached(conn, &format!("player-{conn}"), conn);
        *per_gateway.entry(g).or_insert(0) += 1;
    }
    assert_eq!(per_gateway, HashMap::from([(0, 2), (1, 2)]));
}

#[test]
fn a_login_with_no_gateway_link_up_is_kicked_gateway_unavailable() {
    let mut h = Harness::new(1, |_| {});
    assert!(!h.take().iter().any(|o| matches!(o, Output::Ready(true))));
    let nonce = h.open(1);
    let hello = h.hello("alice", &nonce);
    h.client_sends(1, vec![hello]);
    assert_eq!(
        h.kicked(1),
        (
            KickReason::GatewayUnavailable,
            "no gateway link is up".into()
        )
    );
    assert!(h.sent_to_gateways().is_empty());
}

#[test]
fn a_session_whose_only_gateway_is_gone_is_kicked_once_the_move_times_out() {
    let mut h = Harness::new(1, |cfg| cfg.hello_timeout_ms = 300);
    h.link_up(0, 1);
    h.attached(1, "alice", 1);
    h.take();
    h.feed(Input::LinkDown {
        gateway: 0,
        error: Some("gateway closed the link".into()),
    });
    h.advance(299);
    assert!(h.closed_with(1).is_none(), "waiting for a gateway");
    h.advance(1);
    let (reason, detail) = h.kicked(1);
    assert_eq!(reason, KickReason::GatewayUnavailable);
    assert!(detail.contains("no other gateway link is up"), "{detail}");
}
