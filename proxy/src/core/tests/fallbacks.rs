//! Fallback gateways: another geo's gateways, dialled like this geo's and picked only while none
//! of this geo's is up. A session that went to one stays there until it ends, that link drops,
//! or a gateway of this geo has been back `fallback_return_ms`.

use super::*;

/// This geo's one gateway, and the core geo's, configured after it.
const PRIMARY: GatewayId = 0;
const FALLBACK: GatewayId = 1;
const FALLBACK_ADDR: &str = "10.9.0.1:7200";

/// One primary and one fallback gateway, both links down; sessions never return home.
fn one_primary_one_fallback() -> Harness {
    Harness::new(1, |cfg| {
        cfg.fallback_gateways = vec![FALLBACK_ADDR.into()];
        cfg.fallback_return_ms = 0;
    })
}

/// The `Attach`es sent since the last take: (gateway, account, session id, moved).
fn attaches(h: &mut Harness) -> Vec<(GatewayId, String, u64, bool)> {
    h.sent_to_gateways()
        .into_iter()
        .filter_map(|(to, m, _)| match m {
            Body::Attach(a) => Some((to, a.account, a.session_id, a.moved)),
            _ => None,
        })
        .collect()
}

/// The `FallbackInUse` events said since the last take: (primaries down, fallback).
fn fallback_spells(h: &Harness) -> Vec<(usize, String)> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::FallbackInUse {
                primaries_down,
                gateway,
            } => Some((*primaries_down, gateway.clone())),
            _ => None,
        })
        .collect()
}

fn link_lost(h: &mut Harness, g: GatewayId) {
    h.feed(Input::LinkDown {
        gateway: g,
        error: Some("gateway silent for 5 s".into()),
    });
}

#[test]
fn with_the_primary_up_no_login_goes_to_the_fallback_even_when_the_primary_is_full() {
    let mut h = one_primary_one_fallback();
    // The fallback's link comes up first: it is still not picked.
    h.link_up(FALLBACK, 9);
    h.link_up(PRIMARY, 1);
    for conn in 1..=4 {
        let (g, _) = h.attached(conn, &format!("player-{conn}"), conn);
        assert_eq!(g, PRIMARY, "login {conn}");
    }
    h.gateway_says(
        PRIMARY,
        Body::Admission(Admission {
            open: false,
            reason: "tick_overrun".into(),
            retry_after_ms: 3000,
        }),
    );
    assert!(fallback_spells(&h).is_empty());
    h.take();
    let nonce = h.open(5);
    let hello = h.hello("late", &nonce);
    h.client_sends(5, vec![hello]);
    assert_eq!(h.kicked(5).0, KickReason::ServerFull);
    assert!(
        attaches(&mut h).is_empty(),
        "a full geo does not spill afar"
    );
    assert!(fallback_spells(&h).is_empty());
    let stats = h.core.metrics().stats();
    assert_eq!(
        (stats.sessions_on_fallback, stats.sessions_fallen_back),
        (0, 0)
    );
}

#[test]
fn when_the_only_primary_is_lost_its_sessions_move_to_the_fallback_and_stay_connected() {
    let mut h = one_primary_one_fallback();
    h.link_up(PRIMARY, 1);
    h.link_up(FALLBACK, 9);
    h.attached(1, "alice", 3);
    h.attached(2, "bob", 4);
    h.take();
    link_lost(&mut h, PRIMARY);
    let moved = attaches(&mut h);
    assert_eq!(moved.len(), 2, "{moved:?}");
    assert!(
        moved.iter().all(|(to, _, _, m)| *to == FALLBACK && *m),
        "{moved:?}"
    );
    assert!(h.closed_with(1).is_none() && h.closed_with(2).is_none());
    assert!(
        !h.outputs.iter().any(|o| matches!(o, Output::Ready(false))),
        "a fallback link up keeps the proxy ready"
    );
    assert_eq!(
        fallback_spells(&h),
        [(1, FALLBACK_ADDR.to_string())],
        "said once, not once per session"
    );
    let session_of = |account: &str| {
        moved
            .iter()
            .find(|(_, a, ..)| a == account)
            .map(|(_, _, s, _)| *s)
            .unwrap()
    };
    for (conn, account) in [(1, "alice"), (2, "bob")] {
        let session = session_of(account);
        h.gateway_attaches(FALLBACK, session, 10 + conn);
        assert_eq!(h.welcome(conn).session_id, session);
    }
    h.client_sends(1, vec![input(7)]);
    assert_eq!(h.inputs_sent(), [(FALLBACK, session_of("alice"), 7)]);
    let stats = h.core.metrics().stats();
    assert_eq!(
        (stats.sessions_on_fallback, stats.sessions_fallen_back),
        (2, 2)
    );
    let page = h.metrics_text();
    for needle in [
        "cellmesh_proxy_sessions_on_fallback 2",
        "cellmesh_proxy_sessions_fallen_back_total 2",
    ] {
        assert!(page.contains(needle), "missing {needle} in\n{page}");
    }
    let links = h.core.links_json();
    assert_eq!(
        (links[0]["fallback"].as_bool(), links[0]["up"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(
        (
            links[1]["fallback"].as_bool(),
            links[1]["sessions"].as_u64()
        ),
        (Some(true), Some(2))
    );
    assert!(h
        .core
        .sessions_json()
        .iter()
        .all(|s| s["fallback"] == true && s["gateway"] == FALLBACK_ADDR));
}

#[test]
fn a_login_while_no_primary_is_up_goes_to_the_fallback() {
    let mut h = one_primary_one_fallback();
    assert!(!h.take().iter().any(|o| matches!(o, Output::Ready(true))));
    h.link_up(FALLBACK, 9);
    assert!(
        h.take().iter().any(|o| matches!(o, Output::Ready(true))),
        "a fallback link counts for readiness"
    );
    let (g, _) = h.attached(1, "alice", 1);
    assert_eq!(g, FALLBACK);
    assert_eq!(fallback_spells(&h), [(1, FALLBACK_ADDR.to_string())]);
    let trace = h.take().into_iter().find_map(|o| match o {
        Output::LoginEnded { conn: 1, trace } => Some(trace),
        _ => None,
    });
    assert_eq!(trace.unwrap().gateway.as_deref(), Some(FALLBACK_ADDR));
    assert_eq!(h.core.metrics().stats().sessions_on_fallback, 1);
}

#[test]
fn once_the_primary_is_back_new_logins_go_there_and_without_a_return_sessions_on_the_fallback_stay()
{
    let mut h = one_primary_one_fallback();
    h.link_up(FALLBACK, 9);
    let (_, alice) = h.attached(1, "alice", 1);
    h.take();
    h.advance(50);
    h.link_up(PRIMARY, 1);
    assert!(
        h.sent_to_gateways().is_empty(),
        "no session moves back: no attach, no detach"
    );
    let (g, bob) = h.attached(2, "bob", 2);
    assert_eq!(g, PRIMARY);
    h.take();
    h.client_sends(1, vec![input(1)]);
    h.client_sends(2, vec![input(1)]);
    assert_eq!(h.inputs_sent(), [(FALLBACK, alice, 1), (PRIMARY, bob, 1)]);
    let stats = h.core.metrics().stats();
    assert_eq!(
        (stats.sessions_on_fallback, stats.sessions_fallen_back),
        (1, 1)
    );
    // The fallback's link drops: alice moves, and to this geo's gateway now that it is up.
    link_lost(&mut h, FALLBACK);
    let moved = attaches(&mut h);
    assert!(
        matches!(&moved[..], [(PRIMARY, a, _, true)] if a == "alice"),
        "{moved:?}"
    );
    assert!(h.closed_with(1).is_none());
    assert_eq!(h.core.metrics().stats().sessions_on_fallback, 0);
    // A second outage of this geo is said again.
    h.link_up(FALLBACK, 9);
    h.take();
    link_lost(&mut h, PRIMARY);
    assert_eq!(fallback_spells(&h), [(1, FALLBACK_ADDR.to_string())]);
    let moved = attaches(&mut h);
    assert_eq!(moved.len(), 2, "{moved:?}");
    assert!(moved.iter().all(|(to, ..)| *to == FALLBACK), "{moved:?}");
    assert_eq!(h.core.metrics().stats().sessions_fallen_back, 3);
}

/// With `fallback_return_ms`, the sessions on the fallback move home once this geo's gateway has
/// been back that long: the fallback hears each was displaced (its avatar's leave then waits for
/// the newer session's join), this geo's gateway gets a moved attach from the session's epoch,
/// and the client stays connected. A link that drops and comes back starts the wait again.
#[test]
fn sessions_on_the_fallback_move_home_once_the_primary_held() {
    let mut h = Harness::new(1, |cfg| {
        cfg.fallback_gateways = vec![FALLBACK_ADDR.into()];
        cfg.fallback_return_ms = 10_000;
    });
    h.link_up(FALLBACK, 9);
    let (_, alice) = h.attached(1, "alice", 7);
    h.take();
    h.link_up(PRIMARY, 1);
    h.advance(6_000);
    // The primary flaps: the wait starts again from its return.
    link_lost(&mut h, PRIMARY);
    h.link_up(PRIMARY, 1);
    h.advance(9_000);
    assert!(h.sent_to_gateways().is_empty(), "not before it held 10 s");
    h.advance(1_000);
    let sent = h.sent_to_gateways();
    let detached: Vec<_> = sent
        .iter()
        .filter_map(|(to, m, _)| match m {
            Body::Detach(d) => Some((*to, d.session_id, d.kick_reason, d.detail.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        detached,
        [(FALLBACK, alice, KickReason::Displaced as u32, String::new())]
    );
    let moved: Vec<_> = sent
        .iter()
        .filter_map(|(to, m, _)| match m {
            Body::Attach(a) => Some((*to, a.account.clone(), a.moved, a.moved_from_epoch)),
            _ => None,
        })
        .collect();
    assert_eq!(moved, [(PRIMARY, "alice".to_string(), true, 7)]);
    assert!(h.closed_with(1).is_none(), "the client stays connected");
    assert!(h
        .events()
        .iter()
        .any(|e| matches!(e, Event::ReturningHome { sessions: 1 })));
    let stats = h.core.metrics().stats();
    assert_eq!(
        (stats.sessions_on_fallback, stats.sessions_returned_home),
        (0, 1)
    );
}
