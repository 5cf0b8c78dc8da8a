//! Every kind of bad client input gets a clear kick and disturbs no other client.

mod support;

use std::time::{Duration, Instant};

use cellmesh_proto::edge::{
    client_message, ClientFrame, ClientHello, ClientInput, KickReason, ProtocolVersion,
};
use cellmesh_proto::local::{game_message, GameFrame, Hello};
use cellmesh_proto::mesh::mesh_message::Body as Mesh;
use cellmesh_proto::token;
use cellmesh_proxy::ProxyConfig;
use support::*;

#[tokio::test]
async fn garbage_bytes_are_malformed() {
    let gw = TestGateway::start(1).await;
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
    let gw = TestGateway::start(1).await;
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
    let gw = TestGateway::start(1).await;
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
    let gw = TestGateway::start(1).await;
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

    // An input before the hello is refused by name too.
    let mut early = RawClient::connect(&proxy.addr()).await;
    early
        .write_frame(&ClientFrame::one(client_message::Body::Input(
            ClientInput::default(),
        )))
        .await;
    let k = early.kick().await;
    assert_eq!(reason(&k), KickReason::Malformed);
    assert_eq!(k.detail, "expected ClientHello first, got ClientInput");

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn protocol_version_from_the_future() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    let mut c = RawClient::connect(&proxy.addr()).await;
    c.write_frame(&ClientFrame::one(client_message::Body::Hello(Box::new(
        ClientHello {
            version: Some(ProtocolVersion { major: 2, minor: 7 }),
            ..cellmesh_proto::client::login_hello(&token("future"), b"any").unwrap()
        },
    ))))
    .await;
    let k = c.kick().await;
    assert_eq!(reason(&k), KickReason::VersionMismatch);
    assert_eq!(
        k.detail,
        format!(
            "client protocol 2.7, proxy speaks {}.{}",
            cellmesh_proto::PROTOCOL_MAJOR,
            cellmesh_proto::PROTOCOL_MINOR
        )
    );

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn client_that_never_says_hello() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        hello_timeout_ms: 300,
        ..config(&[&gw])
    })
    .await;
    let mut neighbour = proxy.login("neighbour").await;

    let mut silent = RawClient::connect(&proxy.addr()).await;
    let started = Instant::now();
    let k = silent.kick().await;
    assert_eq!(reason(&k), KickReason::HelloTimeout);
    assert_eq!(k.detail, "no ClientHello within 300 ms");
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "kicked after {:?}",
        started.elapsed()
    );

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn input_flood_is_dropped_counted_then_kicked() {
    let gw = TestGateway::start(1).await;
    let mut cfg = config(&[&gw]);
    cfg.rate.account_inputs_per_sec = 5;
    cfg.rate.account_burst = 10;
    cfg.rate.flood_kick_drops = 20;
    let proxy = TestProxy::start(cfg).await;
    let mut neighbour = proxy.login("neighbour").await;

    let mut flooder = proxy.login("flooder").await;
    for seq in 0..200 {
        if flooder.tx.input(seq, "spam".into()).await.is_err() {
            break;
        }
    }
    let k = flooder.kick().await;
    assert_eq!(reason(&k), KickReason::Flood);

    let stats = proxy.handle.stats();
    assert!(stats.inputs_dropped >= 20, "{stats:?}");
    // The burst got through (and the neighbour's one input); nothing past the limit did.
    assert!((10..=12).contains(&stats.inputs_accepted), "{stats:?}");

    // The neighbour has its own account budget, and the flood never reached the gateway.
    proxy.assert_healthy(&mut neighbour, 1).await;
    let relayed = gw
        .received()
        .iter()
        .filter(|b| matches!(b, Mesh::Input(_)))
        .count();
    assert!(relayed <= 14, "{relayed} inputs reached the gateway");
}

#[tokio::test]
async fn token_signed_with_another_secret() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    // Under a key of its own, the token names a kid this proxy does not hold; under this
    // proxy's kid, the proof made with its signature does not match.
    let own_kid = cellmesh_proto::keys::derived_kid(SECRET.as_bytes());
    let forged_kid = cellmesh_proto::keys::Key {
        kid: own_kid,
        secret: b"not-the-secret".to_vec(),
    };
    for (forged, why) in [
        (
            token::sign(b"not-the-secret", "mallory", unix_now() + 3600),
            "does not accept",
        ),
        (
            token::sign_with(&forged_kid, "mallory", unix_now() + 3600),
            "forged",
        ),
    ] {
        let err = TestClient::login(&proxy.addr(), &forged)
            .await
            .err()
            .expect("forged token admitted");
        let cellmesh_proto::client::ClientError::Kicked(k) = err else {
            panic!("{err}")
        };
        assert_eq!(reason(&k), KickReason::BadToken);
        assert!(k.detail.contains(why), "{}", k.detail);
    }
    assert!(gw
        .received()
        .iter()
        .all(|b| !matches!(b, Mesh::Attach(a) if a.account == "mallory")));

    proxy.assert_healthy(&mut neighbour, 1).await;
}

#[tokio::test]
async fn expired_token() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut neighbour = proxy.login("neighbour").await;

    let stale = token::sign(SECRET.as_bytes(), "late", unix_now() - 10);
    let err = TestClient::login(&proxy.addr(), &stale)
        .await
        .err()
        .expect("expired token admitted");
    let cellmesh_proto::client::ClientError::Kicked(k) = err else {
        panic!("{err}")
    };
    assert_eq!(reason(&k), KickReason::ExpiredToken);

    proxy.assert_healthy(&mut neighbour, 1).await;
}

/// A login key rotates without a flag day: a proxy whose ring holds the new signing key and the
/// old one admits tokens of both, and refuses (by kid, counted) a token of a key retired from
/// it. Every attach it sends carries an attestation for its account.
#[tokio::test]
async fn a_token_key_rotates_and_a_retired_key_is_refused_by_kid() {
    use cellmesh_proto::keys::KeyRing;
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        token_keys: vec!["k2:the-new-key".into(), "k1:the-old-key".into()],
        token_signing_key: "k2".into(),
        ..config(&[&gw])
    })
    .await;
    let key = |entry: &str| {
        KeyRing::parse(&[entry.to_string()], "")
            .unwrap()
            .signing()
            .clone()
    };
    let expiry = unix_now() + 3600;
    for (account, entry) in [("new", "k2:the-new-key"), ("old", "k1:the-old-key")] {
        let t = token::sign_with(&key(entry), account, expiry);
        let c = TestClient::login(&proxy.addr(), &t).await;
        assert!(c.is_ok(), "{entry}: {:?}", c.err());
    }
    let retired = token::sign_with(&key("k0:the-retired-key"), "mallory", expiry);
    let err = TestClient::login(&proxy.addr(), &retired)
        .await
        .err()
        .expect("a token of a retired key admitted");
    let cellmesh_proto::client::ClientError::Kicked(k) = err else {
        panic!("{err}")
    };
    assert_eq!(reason(&k), KickReason::BadToken);
    assert!(k.detail.contains("`k0`"), "{}", k.detail);
    let page = cellmesh_admin::http_get(proxy.handle.admin_addr, "/metrics")
        .await
        .unwrap()
        .1;
    assert!(
        page.contains("cellmesh_proxy_tokens_refused_total{kind=\"unknown_token_kid\"} 1"),
        "{page}"
    );
    // The gateway got an attach for each login, signed for its account and session.
    let attest = KeyRing::parse(&[cellmesh_proto::attest::DEFAULT_KEY.to_string()], "").unwrap();
    let attaches: Vec<_> = gw
        .received()
        .into_iter()
        .filter_map(|b| match b {
            Mesh::Attach(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(attaches.len(), 2);
    for a in attaches {
        cellmesh_proto::attest::verify(
            &attest,
            &a.attestation,
            &a.account,
            a.session_id,
            unix_now() * 1000,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", a.account));
    }
}

/// A login seen on the wire cannot log in again: the hello's proof covers its connection's
/// challenge, so the same bytes on another connection are refused (named, counted), and a whole
/// token sent as a bearer credential is refused whatever else the hello says.
#[tokio::test]
async fn a_replayed_login_is_refused() {
    let gw = TestGateway::start(1).await;
    let proxy = TestProxy::start(config(&[&gw])).await;

    // The real client's login, as a sniffer would record it.
    let mut real = RawClient::connect(&proxy.addr()).await;
    let nonce = real.challenge().await;
    assert_eq!(nonce.len(), 16);
    let hello = cellmesh_proto::client::login_hello(&token("alice"), &nonce).unwrap();
    assert!(!hello.claim.is_empty() && hello.token.is_empty());
    let recorded = ClientFrame::one(client_message::Body::Hello(Box::new(hello)));
    real.write_frame(&recorded).await;
    match real.next_message().await {
        Some(cellmesh_proto::edge::server_message::Body::Welcome(w)) => {
            assert_eq!(w.account, "alice")
        }
        other => panic!("the real login was not welcomed: {other:?}"),
    }

    // The recorded bytes, replayed on a new connection: another challenge, so refused.
    let mut replay = RawClient::connect(&proxy.addr()).await;
    let other_nonce = replay.challenge().await;
    assert_ne!(other_nonce, nonce, "two connections got the same challenge");
    replay.write_frame(&recorded).await;
    let k = replay.kick().await;
    assert_eq!(reason(&k), KickReason::BadToken);
    assert!(k.detail.contains("replayed or forged"), "{}", k.detail);

    // A whole token, as a bearer credential: refused by name.
    let mut bearer = RawClient::connect(&proxy.addr()).await;
    bearer.challenge().await;
    bearer
        .write_frame(&ClientFrame::one(client_message::Body::Hello(Box::new(
            ClientHello {
                version: Some(ProtocolVersion::current()),
                token: token("alice"),
                ..Default::default()
            },
        ))))
        .await;
    let k = bearer.kick().await;
    assert_eq!(reason(&k), KickReason::BadToken);
    assert!(k.detail.contains("sent whole"), "{}", k.detail);

    let page = cellmesh_admin::http_get(proxy.handle.admin_addr, "/metrics")
        .await
        .unwrap()
        .1;
    for kind in ["bad_token_proof", "bearer_token"] {
        assert!(
            page.contains(&format!(
                "cellmesh_proxy_tokens_refused_total{{kind=\"{kind}\"}} 1"
            )),
            "{kind}: {page}"
        );
    }
    // The real session was not disturbed.
    proxy.wait_sessions(1).await;
}
