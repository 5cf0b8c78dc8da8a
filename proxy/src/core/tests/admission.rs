//! Admission: a gateway that says it admits no new session gets none; when every gateway up says
//! so, a login is refused `SERVER_FULL` with the retry hint, and the sessions already attached go
//! on as before.

use cellmesh_proto::mesh::Detach;

use super::*;

fn closed(reason: &str, retry_after_ms: u32) -> Body {
    Body::Admission(Admission {
        open: false,
        reason: reason.into(),
        retry_after_ms,
    })
}

/// Opens `conn` and sends `account`'s hello: the kick it gets.
fn refused(h: &mut Harness, conn: ConnId, account: &str) -> cellmesh_proto::edge::Kick {
    let nonce = h.open(conn);
    let hello = h.hello(account, &nonce);
    h.client_sends(conn, vec![hello]);
    match h.closed_with(conn) {
        Some(Some(server_message::Body::Kick(k))) => k,
        other => panic!("expected a kick for {account}, got {other:?}"),
    }
}

#[test]
fn with_every_gateway_closed_a_login_is_refused_server_full_and_attached_sessions_go_on() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 3);
    let (g, alice) = h.attached(1, "alice", 1);
    h.gateway_says(g, closed("tick_overrun", 4000));
    assert_eq!(h.core.metrics().stats().gateways_closed, 1);
    h.take();
    let k = refused(&mut h, 2, "bob");
    assert_eq!(k.reason, KickReason::ServerFull as i32);
    assert_eq!(k.retry_after_ms, 4000);
    assert!(
        k.detail.contains("node 3: tick_overrun"),
        "the detail says who is full and why: {}",
        k.detail
    );
    assert!(
        h.sent_to_gateways().is_empty(),
        "the gateway never hears of the refused login"
    );
    h.client_sends(1, vec![input(2), input(3)]);
    assert_eq!(h.inputs_sent(), [(g, alice, 2), (g, alice, 3)]);
    let stats = h.core.metrics().stats();
    assert_eq!((stats.logins_refused, stats.sessions), (1, 1), "{stats:?}");
    let page = h.metrics_text();
    for needle in [
        "cellmesh_proxy_logins_refused_total{reason=\"server_full\"} 1",
        "cellmesh_proxy_gateways_closed 1",
        "cellmesh_proxy_kicks_total{reason=\"SERVER_FULL\"} 1",
    ] {
        assert!(page.contains(needle), "missing {needle} in\n{page}");
    }
    assert_eq!(
        h.core.links_json()[0]["admission"],
        serde_json::json!({"open": false, "reason": "tick_overrun", "retry_after_ms": 4000})
    );
    // Open again: the next login gets in.
    h.gateway_says(
        g,
        Body::Admission(Admission {
            open: true,
            ..Default::default()
        }),
    );
    assert_eq!(h.core.metrics().stats().gateways_closed, 0);
    h.attached(3, "bob", 2);
}

#[test]
fn with_one_of_two_gateways_closed_logins_go_to_the_open_one_and_a_relinked_one_stays_closed() {
    let mut h = Harness::new(2, |_| {});
    h.link_up(0, 1);
    h.link_up(1, 2);
    h.gateway_says(0, closed("outbox_pressure", 5000));
    for conn in 1..=6 {
        let (g, _) = h.attached(conn, &format!("player-{conn}"), conn);
        assert_eq!(g, 1, "login {conn} went to the closed one");
    }
    assert_eq!(h.core.metrics().stats().logins_refused, 0);
    // Closed too, and its link breaks and comes back: the new link says at once it is closed.
    h.gateway_says(1, closed("tick_overrun", 3000));
    h.feed(Input::LinkDown {
        gateway: 1,
        error: Some("gateway closed the link".into()),
    });
    h.link_up(1, 2);
    h.gateway_says(1, closed("tick_overrun", 3000));
    assert_eq!(h.core.metrics().stats().gateways_closed, 2);
    h.take();
    let k = refused(&mut h, 10, "late");
    assert_eq!(k.reason, KickReason::ServerFull as i32);
    assert_eq!(k.retry_after_ms, 3000, "the soonest hint of the two");
    assert!(
        k.detail.contains("node 1: outbox_pressure") && k.detail.contains("node 2: tick_overrun"),
        "{}",
        k.detail
    );
}

#[test]
fn an_attach_the_gateway_refuses_is_a_server_full_kick_with_its_hint() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 4);
    let (g, alice) = h.attached(1, "alice", 1);
    // The gateway closed, and the proxy has not heard: its attach answer says so.
    let (_, bob) = h.login(2, "bob");
    h.gateway_says(
        g,
        Body::Detach(Detach {
            session_id: bob,
            kick_reason: KickReason::ServerFull as u32,
            detail: "the server is full: node 4 admits no new session (login_burst)".into(),
            retry_after_ms: 1000,
        }),
    );
    match h.closed_with(2) {
        Some(Some(server_message::Body::Kick(k))) => {
            assert_eq!(k.reason, KickReason::ServerFull as i32);
            assert_eq!(k.retry_after_ms, 1000);
            assert!(k.detail.contains("login_burst"), "{}", k.detail);
        }
        other => panic!("a refused attach must end the login: {other:?}"),
    }
    assert_eq!(h.core.metrics().stats().logins_refused, 1);
    h.client_sends(1, vec![input(1)]);
    assert_eq!(h.inputs_sent(), [(g, alice, 1)]);
}
