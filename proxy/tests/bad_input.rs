//! Bytes a client's codec refuses (garbage, huge or truncated frames, another protocol's frame)
//! get a clear kick and disturb no other client. The refusals of a well-framed login (tokens,
//! versions, replays, floods, a missing hello) are decisions, tested in virtual time in
//! `src/core/tests/logins.rs`.

mod support;

use std::time::{Duration, Instant};

use cellmesh_proto::edge::KickReason;
use cellmesh_proto::local::{game_message, GameFrame, Hello};
use support::*;

#[tokio::test]
async fn garbage_bytes_are_malformed() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    // Text where a length prefix belongs: "GET " reads as a 1.2 GB frame.
    let mut http = RawClient::connect(&proxy.addr()).await;
    http.write(b"GET / HTTP/1.1\r\nHost: proxy\r\n\r\n").await;
    let k = http.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(k.detail.contains("exceeds the maximum"), "{}", k.detail);

    // A small frame whose body is not protobuf.
    let mut junk = RawClient::connect(&proxy.addr()).await;
    junk.write(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).await;
    let k = junk.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(k.detail.contains("undecodable ClientFrame"), "{}", k.detail);

    proxy.assert_healthy(&mut neighbour, 1).await;
    assert!(proxy.handle.stats().kicks >= 2);
}

#[tokio::test]
async fn four_gib_length_prefix_is_refused_at_once() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    let mut c = RawClient::connect(&proxy.addr()).await;
    let started = Instant::now();
    c.write(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]).await;
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(k.detail.contains("4294967295"), "{}", k.detail);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn truncated_frame_then_close() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    let mut c = RawClient::connect(&proxy.addr()).await;
    c.write(&[0, 0, 0, 100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
        .await;
    c.shutdown_write().await;
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(k.detail.contains("14 of 104 bytes"), "{}", k.detail);

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn frame_of_another_protocol_is_named() {
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    // A game server's Hello sent to the edge port: a valid frame, of the wrong protocol.
    let mut c = RawClient::connect(&proxy.addr()).await;
    let game_hello = GameFrame {
        messages: vec![game_message::Body::Hello(Hello {
            version: Some(cellmesh_proto::local::ProtocolVersion::current()),
            tick_rate_hz: 20,
            game: "arena".into(),
        })
        .into()],
    };
    c.write_frame(&game_hello).await;
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert!(k.detail.contains("expected ClientHello"), "{}", k.detail);

    proxy.assert_healthy(&mut neighbour, 1).await;
}
