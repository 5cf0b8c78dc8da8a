//! The edge under pressure: strangers announcing big frames, connection floods, and a gateway
//! that stops reading. Each ends for the client with a clear kick or not at all, and
//! never costs its neighbours their sessions.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use cellmesh_admin::http_get;
use cellmesh_proto::edge::{server_message, KickReason};
use cellmesh_proxy::ProxyConfig;
use support::*;

async fn state(proxy: &TestProxy) -> serde_json::Value {
    let (status, body) = http_get(proxy.handle.admin_addr, "/state").await.unwrap();
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

/// Polls `/state` until the proxy counts `n` open client connections.
async fn until_open(proxy: &TestProxy, n: u64) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let open = state(proxy).await["connections"]["open"].as_u64();
        if open == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "open connections stayed {open:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_stranger_may_announce_only_a_small_frame_a_player_a_bigger_one() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    // Before login: a header announcing 5,000 bytes is refused at once, not held until the hello
    // timeout with the frame's memory reserved.
    let mut stranger = RawClient::connect(&proxy.addr()).await;
    let started = Instant::now();
    stranger.write(&5000u32.to_be_bytes()).await;
    stranger.write(&[0u8; 100]).await;
    let k = stranger.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(
        k.detail
            .contains("frame of 5000 bytes exceeds the maximum of 4096 bytes"),
        "{}",
        k.detail
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );

    // After login, a 12 KB input fits the logged-in limit.
    let payload = Bytes::from(vec![5u8; 12_000]);
    neighbour.echo_payload(7, payload).await;
    // Past seq 7: the gateway hands its game a session's inputs in order.
    proxy.assert_healthy(&mut neighbour, 8).await;
}

#[tokio::test]
async fn connections_past_a_limit_are_told_overloaded_and_the_place_comes_back() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        max_connections_per_address: 3,
        ..config(&[&gw])
    })
    .await;
    let mut neighbour = proxy.login("neighbour").await;
    let idle_a = RawClient::connect(&proxy.addr()).await;
    let _idle_b = RawClient::connect(&proxy.addr()).await;
    until_open(&proxy, 3).await;

    let mut fourth = RawClient::connect(&proxy.addr()).await;
    let k = fourth.kick().await;
    assert_eq!(reason(&k), KickReason::Overloaded);
    assert!(
        k.detail.contains("3 connections per address"),
        "{}",
        k.detail
    );
    assert_eq!(proxy.handle.stats().connections_refused, 1);
    let (_, metrics) = http_get(proxy.handle.admin_addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains("cellmesh_proxy_connections_refused_total{limit=\"address\"} 1"),
        "{metrics}"
    );
    // The logged-in neighbour is not disturbed.
    neighbour.echo(1).await;

    // A connection that leaves gives its place back.
    drop(idle_a);
    until_open(&proxy, 2).await;
    let mut late = proxy.login("late").await;
    late.echo(1).await;
}

#[tokio::test]
async fn the_total_connection_limit_counts_connections_of_every_state() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        max_connections: 2,
        ..config(&[&gw])
    })
    .await;
    let mut a = proxy.login("a").await;
    let _b = RawClient::connect(&proxy.addr()).await;
    let mut c = RawClient::connect(&proxy.addr()).await;
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Overloaded);
    assert!(
        k.detail.contains("maximum of 2 connections"),
        "{}",
        k.detail
    );
    a.echo(1).await;
}

/// A proxy whose gateway link may fill up: tiny link outbox, rate limits out of the way.
fn burst_config(gw: &[&Gateway], stall_ms: u64) -> ProxyConfig {
    let mut cfg = config(gw);
    cfg.link_outbox_frames = 8;
    cfg.link_stall_ms = stall_ms;
    cfg.client_outbox_frames = 8192;
    cfg.rate.account_inputs_per_sec = 100_000;
    cfg.rate.account_burst = 100_000;
    cfg.rate.flood_kick_drops = 100_000;
    cfg
}

/// Sends big inputs until the proxy has dropped some at the full link.
async fn flood_until_link_full(proxy: &TestProxy, c: &mut TestClient) {
    let payload = Bytes::from(vec![1u8; 12_000]);
    let mut seq = 1000;
    while !proxy.handle.stats().inputs_lost.contains_key("link_full") {
        for _ in 0..64 {
            seq += 1;
            c.tx.input(seq, payload.clone()).await.unwrap();
        }
        assert!(
            seq < 20_000,
            "the link never filled: {:?}",
            proxy.handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn a_burst_the_gateway_cannot_take_drops_inputs_not_the_gateways_sessions() {
    let gw = Gateway::stallable(1).await;
    let proxy = TestProxy::start(burst_config(&[&gw], 60_000)).await;
    let mut burster = proxy.login("burster").await;
    let mut neighbour = proxy.login("neighbour").await;
    burster.echo(1).await;
    neighbour.echo(1).await;

    gw.pause_reading();
    flood_until_link_full(&proxy, &mut burster).await;
    let stats = proxy.handle.stats();
    assert_eq!(stats.sessions_moved, 0, "{stats:?}");
    assert_eq!(stats.sessions, 2, "{stats:?}");
    assert_eq!(stats.kicks, 0, "{stats:?}");
    let (_, metrics) = http_get(proxy.handle.admin_addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains("cellmesh_proxy_inputs_lost_total{reason=\"link_full\"}"),
        "{metrics}"
    );

    // The gateway catches up: both sessions carry on, on the same link, with no new Welcome.
    gw.resume_reading();
    neighbour.echo(2).await;
    burster.echo(20_001).await;
    let stats = proxy.handle.stats();
    assert_eq!((stats.sessions_moved, stats.kicks), (0, 0), "{stats:?}");
    let s = state(&proxy).await;
    assert_eq!(s["links"][0]["connects"], 1, "the link never closed: {s:#}");
}

#[tokio::test]
async fn a_sustained_stall_closes_the_link_and_moves_its_sessions() {
    let (gw1, gw2) = (Gateway::stallable(1).await, Gateway::stallable(2).await);
    let proxy = TestProxy::start(burst_config(&[&gw1, &gw2], 300)).await;
    let mut c = proxy.login("stuck").await;
    let stuck = if c.welcome.gateway_node == 1 {
        &gw1
    } else {
        &gw2
    };
    stuck.pause_reading();
    flood_until_link_full(&proxy, &mut c).await;
    // The client keeps pushing: the link stays full (or its writes blocked) past link_stall_ms,
    // so it closes and the session moves to the other gateway on the same connection.
    let payload = Bytes::from(vec![2u8; 12_000]);
    let started = Instant::now();
    let mut seq = 40_000;
    let moved = loop {
        assert!(started.elapsed() < PATIENCE, "{:?}", proxy.handle.stats());
        for _ in 0..16 {
            seq += 1;
            c.tx.input(seq, payload.clone()).await.unwrap();
        }
        let Ok(m) = tokio::time::timeout(Duration::from_millis(5), c.rx.next()).await else {
            continue;
        };
        match m.and_then(|m| m.ok()).and_then(|m| m.body) {
            Some(server_message::Body::Welcome(w)) => break w,
            Some(server_message::Body::Kick(k)) => panic!("kicked: {k:?}"),
            Some(_) => {}
            None => panic!("closed"),
        }
    };
    assert_ne!(moved.gateway_node, c.welcome.gateway_node);
    let s = state(&proxy).await;
    let errors: Vec<String> = s["links"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["last_error"].as_str().map(String::from))
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("the gateway stopped reading")),
        "{errors:?}"
    );
    stuck.resume_reading();
    // Past every seq sent before the move: the new gateway hands the game inputs in order.
    c.echo(90_000).await;
}
