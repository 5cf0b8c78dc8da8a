//! Session life: attach, relay, displacement, idleness, RTT, link loss, gateway choice, shutdown.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use cellmesh_admin::http_get;
use cellmesh_proto::client::ClientError;
use cellmesh_proto::edge::{client_message, server_message, KickReason, Ping};
use cellmesh_proto::mesh::mesh_message::Body as Mesh;
use cellmesh_proxy::ProxyConfig;
use support::*;

async fn state(proxy: &TestProxy) -> serde_json::Value {
    let (status, body) = http_get(proxy.handle.admin_addr, "/state").await.unwrap();
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

#[tokio::test]
async fn attach_relays_inputs_both_ways() {
    let gw = TestGateway::start(7).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut c = proxy.login("alice").await;
    assert_eq!(c.welcome.account, "alice");
    assert_eq!(c.welcome.gateway_node, 7);
    assert_eq!(c.welcome.chunk_size, 32.0);
    for seq in 1..=5 {
        c.echo(seq).await;
    }
    let hello = &gw.hellos()[0];
    assert_eq!(
        (hello.id.as_str(), hello.geo.as_str()),
        ("proxy-test", "local")
    );
    let attach = gw
        .received()
        .into_iter()
        .find_map(|b| {
            if let Mesh::Attach(a) = b {
                Some(a)
            } else {
                None
            }
        })
        .unwrap();
    assert_eq!(
        (attach.account.as_str(), attach.session_id),
        ("alice", c.welcome.session_id)
    );
    assert!(
        attach.remote_addr.starts_with("127.0.0.1:"),
        "{}",
        attach.remote_addr
    );
    let stats = proxy.handle.stats();
    assert_eq!((stats.sessions, stats.inputs_accepted), (1, 5));
    assert!(stats.frames_in >= 6 && stats.frames_out >= 6, "{stats:?}");
}

#[tokio::test]
async fn second_login_displaces_the_first() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut first = proxy.login("alice").await;
    first.echo(1).await;
    let mut second = proxy.login("alice").await;
    assert!(second.welcome.session_id > first.welcome.session_id);
    assert!(second.welcome.session_epoch > first.welcome.session_epoch);

    let k = first.kick().await;
    assert_eq!(reason(&k), KickReason::Displaced);
    assert_eq!(k.detail, "account logged in elsewhere");
    // The gateway ended that session itself: no Detach goes back for it.
    assert!(gw
        .detaches()
        .iter()
        .all(|d| d.session_id != first.welcome.session_id));

    second.echo(2).await;
    proxy.assert_healthy(&mut second, 3).await;
    proxy.wait_sessions(1).await;
}

#[tokio::test]
async fn silent_client_is_kicked_idle() {
    let gw = TestGateway::start(1).await;
    let cfg = ProxyConfig {
        idle_timeout_ms: 400,
        ping_interval_ms: 60_000,
        ..config(&[&gw])
    };
    let proxy = TestProxy::start(cfg).await;
    let mut sleepy = proxy.login("sleepy").await;
    let mut busy = proxy.login("busy").await;
    // The neighbour keeps talking past the idle timeout and is left alone.
    for seq in 0..8 {
        busy.echo(seq).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let k = sleepy.kick().await;
    assert_eq!(reason(&k), KickReason::Idle);
    assert_eq!(k.detail, "no message for 400 ms");
    let sleepy_id = sleepy.welcome.session_id;
    gw.wait_for("Detach{IDLE}", |r| {
        r.iter().any(|b| matches!(b, Mesh::Detach(d) if d.session_id == sleepy_id && d.kick_reason == KickReason::Idle as u32))
    })
    .await;
    proxy.assert_healthy(&mut busy, 100).await;
}

#[tokio::test]
async fn proxy_measures_rtt_itself() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        ping_interval_ms: 30,
        ..config(&[&gw])
    })
    .await;
    let mut c = proxy.login("pinger").await;

    // A client's own ping is answered at once.
    c.tx.send(client_message::Body::Ping(Ping { nonce: 4242 }))
        .await
        .unwrap();
    match c.next().await.and_then(|m| m.body) {
        Some(server_message::Body::Pong(p)) => assert_eq!(p.nonce, 4242),
        other => panic!("expected Pong, got {other:?}"),
    }

    c.pump(Duration::from_millis(400)).await;
    let stats = proxy.handle.stats();
    assert!(stats.rtt_samples >= 3, "{stats:?}");
    assert!(
        stats.rtt_ms_p50 > 0.0 && stats.rtt_ms_p99 >= stats.rtt_ms_p50,
        "{stats:?}"
    );

    let id = c.welcome.session_id;
    let rtts: Vec<_> = gw
        .rtts()
        .into_iter()
        .filter(|r| r.session_id == id)
        .collect();
    assert!(rtts.len() >= 3, "{rtts:?}");
    let last = rtts.last().unwrap();
    assert!(
        last.rtt_ms_min > 0.0 && last.rtt_ms_min <= last.rtt_ms_p50,
        "{last:?}"
    );

    let s = state(&proxy).await;
    let session = &s["sessions"][0];
    assert_eq!(session["account"], "pinger");
    assert!(session["rtt_ms_p50"].as_f64().unwrap() > 0.0, "{session}");
    assert!(session["rtt_ms_min"].as_f64().unwrap() > 0.0, "{session}");
}

#[tokio::test]
async fn bye_detaches_the_session_at_the_gateway() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;
    let c = proxy.login("leaver").await;
    let id = c.welcome.session_id;
    c.tx.close().await.unwrap();
    gw.wait_for("Detach after Bye", |r| {
        r.iter().any(|b| matches!(b, Mesh::Detach(d) if d.session_id == id && d.kick_reason == 0 && d.detail == "bye"))
    })
    .await;
    proxy.assert_healthy(&mut neighbour, 1).await;
    proxy.wait_sessions(1).await;
}

#[tokio::test]
async fn slow_consumer_is_kicked_alone() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        client_outbox_frames: 8,
        ..config(&[&gw])
    })
    .await;
    let slow = proxy.login("slow").await;
    let mut neighbour = proxy.login("neighbour").await;
    // Far more than the socket buffers hold, to a client that never reads.
    gw.push("slow", 1500, 32 * 1024);
    let id = slow.welcome.session_id;
    gw.wait_for("Detach{SLOW_CONSUMER}", |r| {
        r.iter().any(|b| matches!(b, Mesh::Detach(d) if d.session_id == id && d.kick_reason == KickReason::SlowConsumer as u32))
    })
    .await;
    proxy.assert_healthy(&mut neighbour, 1).await;
    drop(slow);
}

/// Reads past anything else until the next `Welcome` on the same connection.
async fn next_welcome(c: &mut TestClient) -> cellmesh_proto::edge::Welcome {
    loop {
        match c.next().await.map(|m| m.body) {
            Some(Some(server_message::Body::Welcome(w))) => return w,
            Some(Some(server_message::Body::Kick(k))) => panic!("kicked instead of moved: {k:?}"),
            Some(_) => {}
            None => panic!("connection closed instead of moving the session"),
        }
    }
}

async fn links_up(proxy: &TestProxy) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while state(proxy).await["links"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l["state"] != "up")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "links never came up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_lost_link_moves_its_sessions_to_another_gateway_on_the_same_connection() {
    let (g1, g2) = (TestGateway::start(1).await, TestGateway::start(2).await);
    let proxy = TestProxy::start(config(&[&g1, &g2])).await;
    links_up(&proxy).await;
    let mut c = proxy.login("alice").await;
    c.echo(1).await;
    let (lost, other) = match c.welcome.gateway_node {
        1 => (&g1, &g2),
        _ => (&g2, &g1),
    };
    lost.drop_links();
    let moved = next_welcome(&mut c).await;
    assert_eq!(moved.account, "alice");
    assert_eq!(
        moved.gateway_node, other.node_id,
        "moved to the gateway whose link is up"
    );
    // The new gateway got an Attach for the account; the client keeps playing through it.
    other
        .wait_for("Attach{alice}", |r| {
            r.iter()
                .any(|b| matches!(b, Mesh::Attach(a) if a.account == "alice" && a.session_id == moved.session_id))
        })
        .await;
    c.echo(2).await;
    let metrics = http_get(proxy.handle.admin_addr, "/metrics")
        .await
        .unwrap()
        .1;
    assert!(
        metrics.contains("cellmesh_proxy_sessions_moved_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_lone_gateway_whose_link_breaks_gets_the_session_back_once_redialled() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut c = proxy.login("alice").await;
    c.echo(1).await;
    gw.drop_links();
    let moved = next_welcome(&mut c).await;
    assert!(
        moved.session_id > c.welcome.session_id,
        "session ids are never reused on a link"
    );
    c.echo(2).await;
    assert_eq!(gw.hellos().len(), 2);
    assert!(proxy.handle.admin.is_ready());
}

#[tokio::test]
async fn a_session_with_no_gateway_left_is_kicked() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        hello_timeout_ms: 300,
        ..config(&[&gw])
    })
    .await;
    let mut c = proxy.login("alice").await;
    c.echo(1).await;
    gw.stop();
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::GatewayUnavailable);
    assert!(
        k.detail.contains("no other gateway link is up"),
        "{}",
        k.detail
    );
}

#[tokio::test]
async fn sessions_are_spread_round_robin_over_gateways() {
    let (g1, g2) = (TestGateway::start(1).await, TestGateway::start(2).await);
    let proxy = TestProxy::start(config(&[&g1, &g2])).await;
    links_up(&proxy).await;
    let mut per_node = HashMap::new();
    let mut clients = Vec::new();
    for i in 0..4 {
        let mut c = proxy.login(&format!("player-{i}")).await;
        c.echo(1).await;
        *per_node.entry(c.welcome.gateway_node).or_insert(0) += 1;
        clients.push(c);
    }
    assert_eq!(per_node, HashMap::from([(1, 2), (2, 2)]));
}

#[tokio::test]
async fn without_a_gateway_the_proxy_is_not_ready() {
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let cfg = ProxyConfig {
        gateways: vec![closed],
        ..config(&[])
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let handle = cellmesh_proxy::start(cfg, stop.clone()).await.unwrap();
    assert_eq!(http_get(handle.admin_addr, "/ready").await.unwrap().0, 503);
    assert_eq!(http_get(handle.admin_addr, "/live").await.unwrap().0, 200);
    let err = TestClient::login(&handle.client_addr.to_string(), &token("alice"))
        .await
        .err()
        .unwrap();
    let ClientError::Kicked(k) = err else {
        panic!("{err}")
    };
    assert_eq!(reason(&k), KickReason::GatewayUnavailable);
    assert_eq!(k.detail, "no gateway link is up");
    stop.cancel();
    tokio::time::timeout(PATIENCE, handle.wait()).await.unwrap();
}

#[tokio::test]
async fn shutdown_flips_readiness_then_kicks_then_stops() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut c = proxy.login("alice").await;
    c.echo(1).await;
    let id = c.welcome.session_id;
    proxy.stop.cancel();
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Reconnect);
    assert!(!proxy.handle.admin.is_ready());
    gw.wait_for("Detach{RECONNECT}", |r| {
        r.iter().any(|b| matches!(b, Mesh::Detach(d) if d.session_id == id && d.kick_reason == KickReason::Reconnect as u32))
    })
    .await;
    let addr = proxy.addr();
    tokio::time::timeout(PATIENCE, proxy.handle.wait())
        .await
        .expect("proxy did not stop");
    assert!(
        tokio::net::TcpStream::connect(&addr).await.is_err(),
        "listener still open"
    );
}

#[tokio::test]
async fn refused_link_is_reported_and_redialled() {
    use cellmesh_proto::codec::FrameCodec;
    use cellmesh_proto::mesh::{LinkRefused, MeshFrame};
    use futures::{SinkExt, StreamExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap().to_string();
    let (dials_tx, mut dials) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let mut framed =
                tokio_util::codec::Framed::new(stream, FrameCodec::<MeshFrame>::default());
            let hello = framed.next().await.unwrap().unwrap();
            let _ = dials_tx.send(hello);
            let refused = LinkRefused {
                reason: "sidecar speaks 2.0, proxy speaks 1.0".into(),
            };
            framed
                .send(MeshFrame::one(Mesh::Refused(refused)))
                .await
                .unwrap();
        }
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let cfg = ProxyConfig {
        gateways: vec![gateway],
        ..config(&[])
    };
    let handle = cellmesh_proxy::start(cfg, stop.clone()).await.unwrap();
    for _ in 0..2 {
        let hello = tokio::time::timeout(PATIENCE, dials.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(&hello.messages[0].body, Some(Mesh::Hello(h)) if h.id == "proxy-test"));
    }
    let (_, body) = http_get(handle.admin_addr, "/state").await.unwrap();
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    let error = state["links"][0]["last_error"].as_str().unwrap();
    assert_eq!(
        error,
        "gateway refused the link: sidecar speaks 2.0, proxy speaks 1.0"
    );
    assert!(!handle.admin.is_ready());
    stop.cancel();
    tokio::time::timeout(PATIENCE, handle.wait()).await.unwrap();
}
