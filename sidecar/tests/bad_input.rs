//! Bad input on the local protocol gets a clear error and disturbs nothing else: every test also
//! checks that the attached game and an attached client session keep working.

mod support;

use std::time::Duration;

use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{self, DeltaKind};
use cellmesh_proto::local::{
    self, game_message::Body, sidecar_message, ErrorCode, GameFrame, SidecarFrame, Vec3,
};
use cellmesh_proto::sdk::{self, SdkConfig, SdkError};
use futures::{SinkExt, StreamExt};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio_util::codec::{FramedRead, FramedWrite};

const QUIET: Duration = Duration::from_millis(300);

/// A scene with alice attached and an NPC beside her.
struct Neighbour {
    s: Scene,
    npc: u64,
    seq: u64,
}

impl Neighbour {
    async fn new() -> Self {
        let mut s = Scene::new().await;
        s.join(1, "alice", chunk(100, 100), vec![]).await;
        let npc = s.id();
        s.game.push(npc_body(npc));
        s.tick().await;
        assert_eq!(kinds(&s.edge.batch(1).await), [(npc, DeltaKind::Appear)]);
        Self { s, npc, seq: 0 }
    }

    /// The game's updates still reach the client, and the client's input the game.
    async fn still_works(&mut self) {
        self.seq += 1;
        let to = chunk(102 + (self.seq % 2) as i64, 101);
        self.s.game.push(move_to(self.npc, to));
        let t = self.s.tick().await;
        let b = self.s.edge.batch(1).await;
        assert_eq!(b.tick, t);
        assert_eq!(kinds(&b), [(self.npc, DeltaKind::Update)]);
        self.s.edge.input(1, self.seq, b"still here").await;
        let seq = self.seq;
        self.s
            .game
            .expect("the input", |m| match m {
                sidecar_message::Body::Input(i) if i.seq == seq => Some(()),
                _ => None,
            })
            .await;
        assert!(self.s.sc.h().stats().game_connected);
    }

    async fn raw(&self) -> RawConn {
        RawConn::open(&self.s.sc.local()).await
    }
}

fn npc_body(id: u64) -> Body {
    npc(id, chunk(101, 101))
}

fn code(e: &local::Error) -> ErrorCode {
    ErrorCode::try_from(e.code).unwrap()
}

#[tokio::test]
async fn garbage_bytes() {
    let mut n = Neighbour::new().await;
    let mut c = n.raw().await;
    c.send(&[0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff]).await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::MalformedFrame);
    assert!(e.detail.contains("undecodable GameFrame"), "{}", e.detail);
    n.still_works().await;

    // Something that is not the local protocol at all: its first bytes read as a huge length.
    let mut c = n.raw().await;
    c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::FrameTooLarge);
    n.still_works().await;
}

#[tokio::test]
async fn a_length_prefix_of_4_gib() {
    let mut n = Neighbour::new().await;
    let mut c = n.raw().await;
    c.send(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]).await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::FrameTooLarge);
    assert!(
        e.detail.contains("4294967295") && e.detail.contains("1048576"),
        "{}",
        e.detail
    );
    n.still_works().await;
    let metrics = n.s.sc.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"frame_too_large\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_truncated_frame() {
    let mut n = Neighbour::new().await;
    let mut c = n.raw().await;
    c.send(&[0, 0, 0, 100]).await;
    c.send(&[0; 10]).await;
    c.stream.shutdown().await.unwrap();
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::MalformedFrame);
    assert!(
        e.detail.contains("ended inside a frame: 14 of 104 bytes"),
        "{}",
        e.detail
    );
    n.still_works().await;
}

#[tokio::test]
async fn a_valid_frame_of_the_wrong_type() {
    let mut n = Neighbour::new().await;
    // An edge client's hello: decodes as an empty GameFrame.
    let client_hello = edge::ClientFrame::one(edge::client_message::Body::Hello(Box::new(
        edge::ClientHello {
            version: Some(edge::ProtocolVersion::current()),
            claim: "alice.1.k1".into(),
            ..Default::default()
        },
    )));
    let mut c = n.raw().await;
    c.send_frame(&client_hello).await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::UnexpectedMessage);
    assert!(
        e.detail.contains("expected Hello") && e.detail.contains("empty frame"),
        "{}",
        e.detail
    );

    // An empty frame.
    let mut c = n.raw().await;
    c.send(&[0, 0, 0, 0]).await;
    assert_eq!(code(&c.fatal_error().await), ErrorCode::UnexpectedMessage);

    // A game message, but not Hello, first.
    let mut c = n.raw().await;
    c.send_frame(&GameFrame {
        messages: vec![Body::TickEnd(local::TickEnd { tick: 1 }).into()],
    })
    .await;
    let e = c.fatal_error().await;
    assert_eq!(e.detail, "expected Hello as the first message, got TickEnd");
    n.still_works().await;
}

#[tokio::test]
async fn a_protocol_version_from_the_future() {
    let mut n = Neighbour::new().await;
    let mut c = n.raw().await;
    c.send_frame(&hello(2, 0)).await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::VersionMismatch);
    assert_eq!(
        e.detail,
        format!(
            "game speaks 2.0, sidecar speaks {}.{}",
            cellmesh_proto::PROTOCOL_MAJOR,
            cellmesh_proto::PROTOCOL_MINOR
        )
    );
    n.still_works().await;
}

#[tokio::test]
async fn update_or_despawn_of_an_id_never_spawned() {
    let mut n = Neighbour::new().await;
    n.s.game.push(move_to(424_242, chunk(1, 1)));
    n.s.game.push(despawn(515_151));
    n.s.tick().await;
    let e = n.s.game.expect_error().await;
    assert_eq!(
        (code(&e), e.entity_id, e.fatal),
        (ErrorCode::UnknownEntity, 424_242, false)
    );
    let e = n.s.game.expect_error().await;
    assert_eq!(
        (code(&e), e.entity_id, e.fatal),
        (ErrorCode::UnknownEntity, 515_151, false)
    );
    // Nothing changed for the client.
    n.s.nothing_for(1, "alice").await;
    n.still_works().await;
}

#[tokio::test]
async fn a_duplicate_spawn_keeps_the_original() {
    let mut n = Neighbour::new().await;
    let dup = local::Spawn {
        entity_id: n.npc,
        position: Some(chunk(500, 500)),
        components: vec![comp(
            9,
            "impostor",
            aud(local::AudienceKind::PublicInRange, &[]),
        )],
        ..Default::default()
    };
    n.s.game.push(Body::Spawn(dup));
    n.s.tick().await;
    let e = n.s.game.expect_error().await;
    assert_eq!(
        (code(&e), e.entity_id, e.fatal),
        (ErrorCode::DuplicateEntity, n.npc, false)
    );
    // The original did not move or change.
    n.s.nothing_for(1, "alice").await;
    n.still_works().await;
    n.s.sc
        .state_until("two entities in /state", |st| st["entities"] == 2)
        .await;
}

#[tokio::test]
async fn invalid_values_are_refused_one_by_one() {
    let mut n = Neighbour::new().await;
    let fresh = n.s.id();
    n.s.game.push(move_to(
        n.npc,
        Vec3 {
            x: f64::NAN,
            y: 0.0,
            z: 0.0,
        },
    ));
    n.s.game.push(npc(
        fresh,
        Vec3 {
            x: f64::INFINITY,
            y: 0.0,
            z: 0.0,
        },
    ));
    n.s.game.push(npc(0, chunk(100, 100)));
    n.s.game.push(change(
        n.npc,
        comp(
            3,
            "x",
            Some(local::Audience {
                kind: 42,
                accounts: vec![],
            }),
        ),
    ));
    n.s.tick().await;
    for (id, what) in [
        (n.npc, "not finite"),
        (fresh, "not finite"),
        (0, "reserved"),
        (n.npc, "audience kind 42"),
    ] {
        let e = n.s.game.expect_error().await;
        assert_eq!(
            (code(&e), e.entity_id, e.fatal),
            (ErrorCode::InvalidValue, id, false),
            "{e:?}"
        );
        assert!(
            e.detail.contains(what),
            "{:?} should mention {what:?}",
            e.detail
        );
    }
    n.s.nothing_for(1, "alice").await;
    n.still_works().await;
}

#[tokio::test]
async fn a_second_game_is_refused_while_the_first_keeps_working() {
    let mut n = Neighbour::new().await;
    let err = sdk::connect(SdkConfig::tcp(n.s.sc.local(), "intruder"))
        .await
        .err()
        .expect("refused");
    match err {
        SdkError::Refused(detail) => assert!(detail.contains("already connected"), "{detail}"),
        other => panic!("expected a refusal, got {other}"),
    }
    let mut c = n.raw().await;
    c.send_frame(&hello(1, 0)).await;
    let e = c.fatal_error().await;
    assert_eq!(code(&e), ErrorCode::AlreadyConnected);
    n.still_works().await;
    n.s.sc
        .state_until("the first game in /state", |st| {
            st["game"]["game"] == "test-game"
        })
        .await;
}

#[tokio::test]
async fn garbage_from_the_attached_game_ends_only_that_game() {
    let sc = TestSidecar::start().await;
    let stream = tokio::net::TcpStream::connect(sc.local()).await.unwrap();
    let (r, w) = stream.into_split();
    let mut rx = FramedRead::new(r, FrameCodec::<SidecarFrame>::default());
    let mut tx = FramedWrite::new(w, FrameCodec::<GameFrame>::default());
    tx.send(hello(1, 0)).await.unwrap();
    let first = within("Welcome", rx.next()).await.unwrap().unwrap();
    assert!(matches!(
        first.messages[0].body,
        Some(sidecar_message::Body::Welcome(_))
    ));

    let mut edge = sc.edge("edge").await;
    let welcome = edge.login(1, "alice").await;
    let join = within("PlayerJoin", rx.next()).await.unwrap().unwrap();
    assert!(
        matches!(&join.messages[0].body, Some(sidecar_message::Body::PlayerJoin(j)) if j.account == "alice")
    );
    let spawn = |b: Body| -> local::GameMessage { b.into() };
    tx.send(GameFrame {
        messages: vec![
            spawn(avatar(11, "alice", chunk(40, 40), vec![])),
            spawn(npc(12, chunk(41, 40))),
            spawn(Body::TickEnd(local::TickEnd { tick: 1 })),
        ],
    })
    .await
    .unwrap();
    assert_eq!(edge.batch(1).await.deltas.len(), 2);

    tx.get_mut()
        .write_all(&[0, 0, 0, 2, 0xff, 0xff])
        .await
        .unwrap();
    let err = within("the Error", rx.next()).await.unwrap().unwrap();
    match &err.messages[0].body {
        Some(sidecar_message::Body::Error(e)) => {
            assert!(e.fatal && e.code == ErrorCode::MalformedFrame as i32)
        }
        other => panic!("{other:?}"),
    }
    assert!(within("close", rx.next()).await.is_none());

    // The client sees the game's entities vanish, and stays attached.
    let b = edge.batch(1).await;
    let mut got = kinds(&b);
    got.sort();
    assert_eq!(got, [(11, DeltaKind::Vanish), (12, DeltaKind::Vanish)]);
    assert!(!sc.h().stats().game_connected);

    // A new game hears about alice again, with where her avatar was.
    let mut game = sc.game().await;
    let join = game.expect_join("alice").await;
    assert_eq!(join.session_epoch, welcome.session_epoch);
    assert_eq!(
        join.last_position.map(|p| (p.x, p.y)),
        Some((40.0 * CHUNK + 16.0, 40.0 * CHUNK + 16.0))
    );
    game.push(avatar(21, "alice", chunk(40, 40), vec![]));
    game.tick(1).await;
    assert_eq!(kinds(&edge.batch(1).await), [(21, DeltaKind::Appear)]);
    assert!(edge.batches_within(1, QUIET).await.is_empty());
}
