//! A login's refusals: a hello out of order or of another version, tokens forged, expired,
//! replayed, sent whole or of a retired key, a client that never says hello, and a flood.

use cellmesh_proto::edge::{ClientHello, ProtocolVersion};
use cellmesh_proto::keys::KeyRing;
use cellmesh_proto::token;

use super::*;

/// Opens `conn`, sends `body` first and returns the kick.
fn kicked_after(h: &mut Harness, conn: ConnId, body: client_message::Body) -> (KickReason, String) {
    h.open(conn);
    h.client_sends(conn, vec![body]);
    h.kicked(conn)
}

#[test]
fn an_input_before_the_hello_is_refused_by_name() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let got = kicked_after(&mut h, 1, input(1));
    assert_eq!(
        got,
        (
            KickReason::Malformed,
            "expected ClientHello first, got ClientInput".into()
        )
    );
}

#[test]
fn a_hello_of_a_future_protocol_version_is_refused_by_version() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let hello = ClientHello {
        version: Some(ProtocolVersion { major: 2, minor: 7 }),
        ..cellmesh_proto::client::login_hello(&h.token("future"), b"any").unwrap()
    };
    let got = kicked_after(&mut h, 1, client_message::Body::Hello(Box::new(hello)));
    assert_eq!(
        got,
        (
            KickReason::VersionMismatch,
            format!(
                "client protocol 2.7, proxy speaks {}.{}",
                cellmesh_proto::PROTOCOL_MAJOR,
                cellmesh_proto::PROTOCOL_MINOR
            )
        )
    );
}

#[test]
fn a_client_that_never_says_hello_is_told_the_deadline() {
    let mut h = Harness::new(1, |cfg| cfg.hello_timeout_ms = 300);
    h.link_up(0, 1);
    h.attached(1, "neighbour", 1);
    h.open(2);
    h.advance(299);
    assert!(h.closed_with(2).is_none());
    h.advance(1);
    assert_eq!(
        h.kicked(2),
        (
            KickReason::HelloTimeout,
            "no ClientHello within 300 ms".into()
        )
    );
    assert!(h.closed_with(1).is_none(), "the neighbour stays");
}

#[test]
fn tokens_of_another_secret_or_expired_are_refused_and_never_reach_a_gateway() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    h.take();
    let expiry = UNIX_MS / 1000 + 3600;
    // Under a key of its own, the token names a kid this proxy does not hold; under this
    // proxy's kid, the proof made with its signature does not match.
    let own_kid = cellmesh_proto::keys::derived_kid(h.cfg.token_secret.as_bytes());
    let forged_kid = cellmesh_proto::keys::Key {
        kid: own_kid,
        secret: b"not-the-secret".to_vec(),
    };
    let cases = [
        (
            token::sign(b"not-the-secret", "mallory", expiry),
            KickReason::BadToken,
            "does not accept",
        ),
        (
            token::sign_with(&forged_kid, "mallory", expiry),
            KickReason::BadToken,
            "forged",
        ),
        (
            token::sign(h.cfg.token_secret.as_bytes(), "late", UNIX_MS / 1000 - 10),
            KickReason::ExpiredToken,
            "",
        ),
    ];
    for (conn, (token, reason, why)) in (1..).zip(cases) {
        let nonce = h.open(conn);
        h.client_sends(conn, vec![hello_with(&token, &nonce)]);
        let (got, detail) = h.kicked(conn);
        assert_eq!(got, reason, "{detail}");
        assert!(detail.contains(why), "{detail}");
    }
    assert!(h.sent_to_gateways().is_empty(), "no attach for a refusal");
    h.attached(10, "neighbour", 1);
}

/// A login key rotates without a flag day: a proxy whose ring holds the new signing key and the
/// old one admits tokens of both, and refuses (by kid, counted) a token of a key retired from
/// it. Every attach it sends carries an attestation for its account.
#[test]
fn a_token_key_rotates_and_a_retired_key_is_refused_by_kid() {
    let mut h = Harness::new(1, |cfg| {
        cfg.token_keys = vec!["k2:the-new-key".into(), "k1:the-old-key".into()];
        cfg.token_signing_key = "k2".into();
    });
    h.link_up(0, 1);
    h.take();
    let key = |entry: &str| {
        KeyRing::parse(&[entry.to_string()], "")
            .unwrap()
            .signing()
            .clone()
    };
    let expiry = UNIX_MS / 1000 + 3600;
    let mut attaches = Vec::new();
    for (conn, (account, entry)) in
        (1..).zip([("new", "k2:the-new-key"), ("old", "k1:the-old-key")])
    {
        let nonce = h.open(conn);
        let t = token::sign_with(&key(entry), account, expiry);
        h.client_sends(conn, vec![hello_with(&t, &nonce)]);
        attaches.extend(
            h.sent_to_gateways()
                .into_iter()
                .filter_map(|(_, m, _)| match m {
                    Body::Attach(a) => Some(a),
                    _ => None,
                }),
        );
        assert!(h.closed_with(conn).is_none(), "{entry} refused");
    }
    let nonce = h.open(3);
    let retired = token::sign_with(&key("k0:the-retired-key"), "mallory", expiry);
    h.client_sends(3, vec![hello_with(&retired, &nonce)]);
    let (reason, detail) = h.kicked(3);
    assert_eq!(reason, KickReason::BadToken);
    assert!(detail.contains("`k0`"), "{detail}");
    let page = h.metrics_text();
    assert!(
        page.contains("cellmesh_proxy_tokens_refused_total{kind=\"unknown_token_kid\"} 1"),
        "{page}"
    );
    // The gateway got an attach for each login, signed for its account and session.
    let attest = KeyRing::parse(&[cellmesh_proto::attest::DEFAULT_KEY.to_string()], "").unwrap();
    assert_eq!(attaches.len(), 2);
    for a in attaches {
        cellmesh_proto::attest::verify(&attest, &a.attestation, &a.account, a.session_id, UNIX_MS)
            .unwrap_or_else(|e| panic!("{}: {e}", a.account));
    }
}

/// A login seen on the wire cannot log in again: the hello's proof covers its connection's
/// challenge, so the same hello on another connection is refused (named, counted), and a whole
/// token sent as a bearer credential is refused whatever else the hello says.
#[test]
fn a_replayed_or_bearer_login_is_refused_by_name_and_counted() {
    let mut h = Harness::new(1, |_| {});
    h.link_up(0, 1);
    let nonce = h.open(1);
    assert_eq!(nonce.len(), 16);
    let hello = h.hello("alice", &nonce);
    let client_message::Body::Hello(recorded) = &hello else {
        unreachable!()
    };
    assert!(!recorded.claim.is_empty() && recorded.token.is_empty());
    h.client_sends(1, vec![hello.clone()]);
    let (g, session) = h
        .sent_to_gateways()
        .into_iter()
        .find_map(|(g, m, _)| match m {
            Body::Attach(a) => Some((g, a.session_id)),
            _ => None,
        })
        .expect("the real login attaches");
    h.gateway_attaches(g, session, 1);
    assert_eq!(h.welcome(1).account, "alice");

    let other_nonce = h.open(2);
    assert_ne!(other_nonce, nonce, "two connections got the same challenge");
    h.client_sends(2, vec![hello]);
    let (reason, detail) = h.kicked(2);
    assert_eq!(reason, KickReason::BadToken);
    assert!(detail.contains("replayed or forged"), "{detail}");

    let bearer = ClientHello {
        version: Some(ProtocolVersion::current()),
        token: h.token("alice"),
        ..Default::default()
    };
    let (reason, detail) = kicked_after(&mut h, 3, client_message::Body::Hello(Box::new(bearer)));
    assert_eq!(reason, KickReason::BadToken);
    assert!(detail.contains("sent whole"), "{detail}");

    let page = h.metrics_text();
    for kind in ["bad_token_proof", "bearer_token"] {
        let line = format!("cellmesh_proxy_tokens_refused_total{{kind=\"{kind}\"}} 1");
        assert!(page.contains(&line), "{kind}: {page}");
    }
    assert!(h.closed_with(1).is_none(), "the real session stays");
    assert_eq!(h.core.sessions_json().len(), 1);
}

#[test]
fn a_flood_is_dropped_and_counted_then_kicked_and_a_neighbour_keeps_its_own_budget() {
    let mut h = Harness::new(1, |cfg| {
        cfg.rate.account_inputs_per_sec = 5;
        cfg.rate.account_burst = 10;
        cfg.rate.flood_kick_drops = 20;
    });
    h.link_up(0, 1);
    h.attached(1, "neighbour", 1);
    let (_, flooder) = h.attached(2, "flooder", 2);
    h.take();
    for seq in 0..200 {
        h.client_sends(2, vec![input(seq)]);
        if h.outputs
            .iter()
            .any(|o| matches!(o, Output::CloseClient { conn: 2, .. }))
        {
            break;
        }
    }
    assert_eq!(h.kicked(2).0, KickReason::Flood);
    let relayed = h
        .inputs_sent()
        .into_iter()
        .filter(|(_, s, _)| *s == flooder)
        .count();
    assert_eq!(relayed, 10, "the burst passes, nothing past the limit");
    let stats = h.core.metrics().stats();
    assert!(stats.inputs_dropped >= 20, "{stats:?}");
    assert_eq!(stats.inputs_accepted, 10, "{stats:?}");
    assert!(h
        .metrics_text()
        .contains("cellmesh_proxy_kicks_total{reason=\"FLOOD\"} 1"));
    h.client_sends(1, vec![input(1)]);
    assert_eq!(
        h.inputs_sent().len(),
        1,
        "the neighbour's budget is its own"
    );
}
