//! A session over real sockets through a real gateway: attach and relay both ways, no gateway,
//! a refused link, shutdown. The decisions of a session's life are tested in virtual time in
//! `src/core/tests/`.

mod support;

use std::time::Duration;

use cellmesh_admin::http_get;
use cellmesh_proto::client::ClientError;
use cellmesh_proto::edge::KickReason;
use cellmesh_proto::mesh::mesh_message::Body as Mesh;
use cellmesh_proxy::ProxyConfig;
use support::*;

#[tokio::test]
async fn attach_relays_inputs_both_ways() {
    let gw = Gateway::start(7).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut c = proxy.login("alice").await;
    assert_eq!(c.welcome.account, "alice");
    assert_eq!(c.welcome.gateway_node, 7);
    assert_eq!(c.welcome.chunk_size, 32.0);
    for seq in 1..=5 {
        c.echo(seq).await;
    }
    // The game got the five inputs of alice's session, in order, under the welcome's epoch.
    let inputs: Vec<(String, u64, u64)> = gw
        .game
        .inputs()
        .into_iter()
        .map(|i| (i.account, i.session_epoch, i.seq))
        .collect();
    let epoch = c.welcome.session_epoch;
    let expected: Vec<(String, u64, u64)> =
        (1..=5).map(|seq| ("alice".into(), epoch, seq)).collect();
    assert_eq!(inputs, expected);
    // The gateway knows the proxy by its name and the session by its id and client address.
    let state = gw
        .state_until("the session in the sidecar's state", |s| {
            s["sessions"].as_array().is_some_and(|a| !a.is_empty())
        })
        .await;
    let link = &state["links"][0];
    assert_eq!(
        (&link["proxy"], &link["geo"]),
        (&"proxy-test".into(), &"local".into())
    );
    let session = &state["sessions"][0];
    assert_eq!(session["account"], "alice");
    assert_eq!(session["session_id"], c.welcome.session_id);
    let remote = session["remote_addr"].as_str().unwrap();
    assert!(remote.starts_with("127.0.0.1:"), "{remote}");
    let stats = proxy.handle.stats();
    assert_eq!((stats.sessions, stats.inputs_accepted), (1, 5));
    assert!(stats.frames_in >= 6 && stats.frames_out >= 6, "{stats:?}");
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
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut c = proxy.login("alice").await;
    c.echo(1).await;
    proxy.stop.cancel();
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Reconnect);
    assert!(!proxy.handle.admin.is_ready());
    gw.game
        .wait_for("alice's session to leave the game", |g| {
            g.leaves().iter().any(|(account, _)| account == "alice")
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

#[tokio::test]
async fn a_client_that_stops_reading_is_kicked_slow_consumer_alone() {
    let gw = Gateway::start(1).await;
    let mut cfg = ProxyConfig {
        client_outbox_frames: 8,
        ..config(&[&gw])
    };
    cfg.rate.account_inputs_per_sec = 100_000;
    cfg.rate.account_burst = 100_000;
    cfg.rate.flood_kick_drops = 100_000;
    let proxy = TestProxy::start(cfg).await;
    let mut slow = proxy.login("slow").await;
    let mut neighbour = proxy.login("neighbour").await;
    // Far more than the socket buffers hold, to a client that never reads: 48 MB over a
    // second's ticks.
    for seq in 1..=30 {
        if slow.tx.input(seq, "flood 50".into()).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    gw.game
        .wait_for("the slow session to leave the game", |g| {
            g.leaves().iter().any(|(account, _)| account == "slow")
        })
        .await;
    let leaves = gw.game.leaves();
    assert!(
        leaves[0].1.starts_with("slow_consumer"),
        "the gateway hears why: {leaves:?}"
    );
    let page = http_get(proxy.handle.admin_addr, "/metrics")
        .await
        .unwrap()
        .1;
    assert!(
        page.contains("cellmesh_proxy_kicks_total{reason=\"SLOW_CONSUMER\"} 1"),
        "{page}"
    );
    proxy.assert_healthy(&mut neighbour, 1).await;
    drop(slow);
}
