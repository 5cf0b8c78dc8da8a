//! Leaving: a drain serves through its grace, then spreads its reconnect kicks, and tells each
//! gateway; a stop now cuts it short.

use super::*;

#[test]
fn a_drain_lets_newcomers_in_through_the_grace_then_spreads_its_kicks_and_detaches_each() {
    let (grace, spread) = (600, 800);
    let mut h = Harness::new(1, |cfg| {
        cfg.drain_grace_ms = grace;
        cfg.drain_spread_ms = spread;
    });
    h.link_up(0, 1);
    let mut sessions = HashMap::new();
    for conn in 1..=5 {
        sessions.insert(conn, h.attached(conn, &format!("player-{conn}"), conn).1);
    }
    h.take();
    h.feed(Input::Drain);
    assert!(h.take().iter().any(|o| matches!(o, Output::Ready(false))));
    // Within the grace everyone is served, and a newcomer is still let in.
    h.advance(grace / 2);
    sessions.insert(6, h.attached(6, "newcomer", 6).1);
    h.client_sends(1, vec![input(1)]);
    assert_eq!(h.inputs_sent().len(), 1);
    h.advance(grace - grace / 2 - 1);
    assert!(!h
        .outputs
        .iter()
        .any(|o| matches!(o, Output::CloseClient { .. })));
    // Each kick's moment, read in steps of 10 ms.
    let mut kicked_at = HashMap::new();
    let mut detached = Vec::new();
    let mut elapsed = grace - 1;
    while kicked_at.len() < 6 {
        assert!(elapsed <= grace + spread + 10, "kicked only {kicked_at:?}");
        h.advance(10);
        elapsed += 10;
        for conn in 1..=6 {
            if kicked_at.contains_key(&conn) || h.closed_with(conn).is_none() {
                continue;
            }
            kicked_at.insert(conn, elapsed);
        }
        detached.extend(
            h.sent_to_gateways()
                .into_iter()
                .filter_map(|(_, m, _)| match m {
                    Body::Detach(d) if d.kick_reason == KickReason::Reconnect as u32 => {
                        Some(d.session_id)
                    }
                    _ => None,
                }),
        );
    }
    let first = *kicked_at.values().min().unwrap();
    let last = *kicked_at.values().max().unwrap();
    assert!(first >= grace, "kicked within the grace: {kicked_at:?}");
    // Six clients in six slots of the spread: the first and last are at least four slots apart.
    assert!(
        last - first >= spread * 4 / 6,
        "kicks not spread: {kicked_at:?}"
    );
    detached.sort();
    let mut all: Vec<u64> = sessions.values().copied().collect();
    all.sort();
    assert_eq!(detached, all, "each gateway hears its session is gone");
    assert!(h.outputs.iter().any(|o| matches!(o, Output::StopAccepting)));
    assert!(h.outputs.iter().any(|o| matches!(o, Output::Stopped)));
}

#[test]
fn each_drain_kick_asks_the_client_to_reconnect() {
    let mut h = Harness::new(1, |cfg| {
        cfg.drain_grace_ms = 0;
        cfg.drain_spread_ms = 0;
    });
    h.link_up(0, 1);
    h.attached(1, "alice", 1);
    h.take();
    h.feed(Input::Drain);
    h.advance(1);
    let (reason, detail) = h.kicked(1);
    assert_eq!(reason, KickReason::Reconnect);
    assert!(detail.contains("reconnect"), "{detail}");
}

#[test]
fn stop_now_cuts_a_drain_short_with_a_shutdown_kick() {
    let mut h = Harness::new(1, |cfg| {
        cfg.drain_grace_ms = 60_000;
        cfg.drain_spread_ms = 60_000;
    });
    h.link_up(0, 1);
    let (g, session) = h.attached(1, "alice", 1);
    h.take();
    h.feed(Input::Drain);
    h.advance(1000);
    h.client_sends(1, vec![input(1)]);
    assert_eq!(h.inputs_sent(), [(g, session, 1)], "served in the grace");
    h.feed(Input::StopNow);
    assert_eq!(h.kicked(1).0, KickReason::Shutdown);
    assert!(h.outputs.iter().any(|o| matches!(o, Output::Stopped)));
}
