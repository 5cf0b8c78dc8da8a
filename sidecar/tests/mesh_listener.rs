//! The mesh listener before a peer has said who it is: a stranger can make it hold little, and
//! for little time, and the peers that do say who they are still get in.

mod support;

use std::time::Duration;

use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::mesh::{mesh_message, MeshFrame};
use cellmesh_sidecar::SidecarConfig;
use futures::{SinkExt, StreamExt};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};

/// What the sidecar says to a connection that announced a 5000-byte first frame: before, it
/// waited for the 5000 bytes (a megabyte would have been taken) until the hello timeout.
#[tokio::test]
async fn a_first_frame_larger_than_a_hello_is_refused_at_once() {
    let s = TestSidecar::start().await;
    let mut stream = TcpStream::connect(s.mesh()).await.unwrap();
    stream.write_all(&5000u32.to_be_bytes()).await.unwrap();
    stream.write_all(&[0; 100]).await.unwrap();
    let mut reader = FramedRead::new(stream, FrameCodec::<MeshFrame>::default());
    let answer = tokio::time::timeout(Duration::from_secs(3), reader.next())
        .await
        .expect("refused before the hello timeout")
        .expect("a frame")
        .expect("a well-formed frame");
    match answer.messages.into_iter().next().and_then(|m| m.body) {
        Some(mesh_message::Body::Refused(r)) => {
            assert!(
                r.reason.contains("5000") && r.reason.contains("4096"),
                "{r:?}"
            )
        }
        other => panic!("expected LinkRefused, got {other:?}"),
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"frame_too_large\"} 1"),
        "{metrics}"
    );
    // A peer that says who it is gets in, and may then send frames as large as the config lets.
    let _peer = RawPeer::proxy(s.mesh(), "proxy-a").await;
}

/// Idle connections that never say hello hold at most 256 handshakes: the next is closed at once,
/// counted, and a peer gets in again as soon as they are gone.
#[tokio::test]
async fn connections_in_their_handshake_are_capped() {
    let s = TestSidecar::start().await;
    let mut idle = Vec::new();
    for _ in 0..256 {
        idle.push(TcpStream::connect(s.mesh()).await.unwrap());
    }
    // The 257th is accepted by the kernel, then closed by the sidecar without a word.
    let mut one_more = TcpStream::connect(s.mesh()).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(3), one_more.read(&mut buf))
        .await
        .expect("closed before the hello timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"handshakes_full\"} 1"),
        "{metrics}"
    );
    drop(idle);
    // Their handshakes end as the sidecar reads their close: a peer that dials until it is
    // answered gets in.
    cellmesh_test_support::within("a peer answered again", async {
        loop {
            let stream = TcpStream::connect(s.mesh()).await.unwrap();
            let (r, w) = stream.into_split();
            let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
            writer.send(link_hello("proxy-a", 1)).await.unwrap();
            let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
            if let Some(Ok(f)) = reader.next().await {
                if let Some(mesh_message::Body::Hello(_)) =
                    f.messages.into_iter().next().and_then(|m| m.body)
                {
                    break;
                }
            }
        }
    })
    .await;
}

/// A proxy link names accounts, but only an attestation signed under the shared attest key lets
/// one attach: before, any peer that reached the listener could attach any account.
#[tokio::test]
async fn an_attach_needs_an_attestation_for_its_account_under_the_attest_key() {
    use cellmesh_proto::mesh;
    let s = TestSidecar::start_with(SidecarConfig {
        attest_keys: vec!["a2:the-new-key".into(), "a1:the-old-key".into()],
        ..test_config()
    })
    .await;
    let mut link = RawPeer::proxy(s.mesh(), "proxy-a").await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let key = |entry: &str| {
        cellmesh_proto::keys::KeyRing::parse(&[entry.to_string()], "")
            .unwrap()
            .signing()
            .clone()
    };
    let (old, retired) = (key("a1:the-old-key"), key("a0:the-retired-key"));
    let sign = |k: &cellmesh_proto::keys::Key, account: &str, session: u64, at: u64| {
        cellmesh_proto::attest::sign(k, account, session, at)
    };
    let refusals = [
        (1, String::new(), "attach carries no attestation", "missing"),
        (
            2,
            sign(&old, "mallory", 2, now),
            "another account",
            "bad_signature",
        ),
        (
            3,
            sign(&retired, "alice", 3, now),
            "key `a0`",
            "unknown_kid",
        ),
        (
            4,
            sign(&old, "alice", 4, now - 61_000),
            "expired",
            "expired",
        ),
    ];
    for (session_id, attestation, why, _) in &refusals {
        link.send(mesh_message::Body::Attach(mesh::Attach {
            session_id: *session_id,
            account: "alice".into(),
            remote_addr: "127.0.0.1:1".into(),
            attestation: attestation.clone(),
            ..Default::default()
        }))
        .await;
        let d = link.expect_detach(*session_id).await;
        assert_eq!(
            d.kick_reason,
            cellmesh_proto::edge::KickReason::GatewayUnavailable as u32
        );
        assert!(
            d.detail.starts_with("attach refused") && d.detail.contains(why),
            "session {session_id}: {}",
            d.detail
        );
    }
    let metrics = s.metrics().await;
    for (_, _, _, kind) in &refusals {
        assert!(
            metrics.contains(&format!(
                "cellmesh_sidecar_attaches_refused_total{{kind=\"{kind}\"}} 1"
            )),
            "{kind}: {metrics}"
        );
    }
    assert!(
        metrics.contains("cellmesh_sidecar_sessions 0"),
        "nobody attached: {metrics}"
    );
    // Signed under an accepted key that no longer signs (a rotation under way): attached.
    link.send(mesh_message::Body::Attach(mesh::Attach {
        session_id: 5,
        account: "alice".into(),
        remote_addr: "127.0.0.1:1".into(),
        attestation: sign(&old, "alice", 5, now),
        ..Default::default()
    }))
    .await;
    link.expect("Attached for session 5", |m| match m {
        mesh_message::Body::Attached(a) if a.session_id == 5 => Some(()),
        mesh_message::Body::Detach(d) if d.session_id == 5 => panic!("refused: {d:?}"),
        _ => None,
    })
    .await;
}

/// A sidecar whose mesh listener other hosts reach does not start on the public attest key.
#[test]
fn off_loopback_a_sidecar_needs_its_attest_keys() {
    let tls = cellmesh_trust::MeshTlsConfig {
        ca: "ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
    };
    let open = SidecarConfig {
        mesh_listen: "0.0.0.0:7200".into(),
        mesh_tls: tls,
        attest_keys: Vec::new(),
        ..test_config()
    };
    let err = open.validate().unwrap_err().to_string();
    assert!(
        err.contains("attest_keys") && err.contains("CELLMESH_ATTEST_KEYS"),
        "{err}"
    );
    SidecarConfig {
        attest_keys: vec!["a1:shared".into()],
        ..open
    }
    .validate()
    .unwrap();
}

/// A peer sidecar whose list of the world's geos differs is refused at the link, with the
/// reason; one listing the same geos in another order gets in.
#[tokio::test]
async fn a_peer_sidecar_listing_other_world_geos_is_refused() {
    let s = TestSidecar::start_with(SidecarConfig {
        geo: "eu".into(),
        geos: vec!["eu".into(), "us".into()],
        ..test_config()
    })
    .await;
    let hello = |geos: &[&str]| {
        MeshFrame::one(mesh_message::Body::Hello(cellmesh_proto::mesh::LinkHello {
            version: Some(cellmesh_proto::mesh::ProtocolVersion::current()),
            role: cellmesh_proto::mesh::PeerRole::Sidecar as i32,
            id: "3".into(),
            geo: "us".into(),
            node_id: 3,
            world_geos: geos.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }))
    };
    let addr = s.mesh();
    let answer = |geos: &'static [&'static str]| async move {
        let (r, w) = TcpStream::connect(addr).await.unwrap().into_split();
        let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
        writer.send(hello(geos)).await.unwrap();
        let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
        tokio::time::timeout(Duration::from_secs(3), reader.next())
            .await
            .expect("an answer")
            .expect("a frame")
            .expect("a well-formed frame")
            .messages
            .into_iter()
            .next()
            .and_then(|m| m.body)
    };
    match answer(&["eu", "ap"]).await {
        Some(mesh_message::Body::Refused(r)) => {
            assert!(r.reason.contains("two homes"), "{r:?}")
        }
        other => panic!("expected LinkRefused, got {other:?}"),
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"link_refused\"} 1"),
        "{metrics}"
    );
    match answer(&["us", "eu"]).await {
        Some(mesh_message::Body::Hello(h)) => assert_eq!(h.world_geos, ["eu", "us"]),
        other => panic!("expected its LinkHello, got {other:?}"),
    }
}
