//! Handshakes, ids, sessions coming and going, links dying, shutdown: over real sockets.

mod support;

use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{DeltaKind, KickReason};
use cellmesh_proto::local::{game_message::Body, sidecar_message, AudienceKind, ErrorCode};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, PeerRole};
use cellmesh_sidecar::ids;
use cellmesh_stores::PlayerRecord;
use futures::{SinkExt, StreamExt};
use support::*;
use tokio_util::codec::{FramedRead, FramedWrite};

const QUIET: Duration = Duration::from_millis(300);

#[tokio::test]
async fn handshake_welcome_and_readiness() {
    let sc = TestSidecar::start().await;
    assert!(sc.h().local_addr.starts_with("127.0.0.1:") && !sc.h().local_addr.ends_with(":0"));
    let admin = sc.h().admin_addr;
    assert_eq!(
        cellmesh_admin::http_get(admin, "/live").await.unwrap().0,
        200
    );
    assert_eq!(
        cellmesh_admin::http_get(admin, "/ready").await.unwrap().0,
        503,
        "no game yet"
    );
    let game = sc.game().await;
    let w = &game.welcome;
    assert_eq!(w.node_id, 7);
    assert_eq!(w.version.unwrap().major, 1);
    let world = w.world.unwrap();
    assert_eq!(
        (
            world.width,
            world.height,
            world.chunk_size,
            world.region_size
        ),
        (131_072.0, 131_072.0, 32.0, 8_192.0)
    );
    assert_eq!(w.owned_area.len(), 1);
    let area = w.owned_area[0];
    assert_eq!(
        (area.x, area.y, area.width, area.height),
        (0.0, 0.0, 131_072.0, 131_072.0)
    );
    assert_eq!(w.partition_epoch, 0);
    assert_eq!(
        cellmesh_admin::http_get(admin, "/ready").await.unwrap().0,
        200
    );
    let state = sc
        .state_until("the game in /state", |s| s["game_connected"] == true)
        .await;
    assert_eq!(state["node_id"], 7);
    assert_eq!(
        state["game"]["version"],
        format!(
            "{}.{}",
            cellmesh_proto::PROTOCOL_MAJOR,
            cellmesh_proto::PROTOCOL_MINOR
        )
    );
    assert!(sc.h().stats().game_connected);
    let metrics = sc.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_connections{peer=\"game\"} 1"),
        "{metrics}"
    );
    // Closing the game makes the node not ready again.
    game.tx.close().await.unwrap();
    drop(game.rx);
    sc.state_until("the game gone", |s| s["game_connected"] == false)
        .await;
    assert_eq!(
        cellmesh_admin::http_get(admin, "/ready").await.unwrap().0,
        503
    );
}

#[tokio::test]
async fn a_newer_minor_version_is_served() {
    let sc = TestSidecar::start().await;
    let mut c = RawConn::open(&sc.local()).await;
    c.send_frame(&hello(1, 9)).await;
    let mut rx = FramedRead::new(
        c.stream,
        FrameCodec::<cellmesh_proto::local::SidecarFrame>::default(),
    );
    let f = within("Welcome", rx.next()).await.unwrap().unwrap();
    assert!(matches!(
        f.messages[0].body,
        Some(sidecar_message::Body::Welcome(_))
    ));
}

#[tokio::test]
async fn reserve_ids_mints_unique_snowflakes_of_this_node() {
    let sc = TestSidecar::start().await;
    let mut game = sc.game().await;
    let a = game.reserve(500).await;
    let b = game.reserve(5000).await;
    assert_eq!((a.len(), b.len()), (500, 5000));
    let all: Vec<u64> = a.iter().chain(&b).copied().collect();
    assert!(all.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
    assert!(all.iter().all(|id| ids::split(*id).node == 7 && *id != 0));
    // A request too big for one answer is refused, and the connection carries on.
    game.push(Body::ReserveIds(cellmesh_proto::local::ReserveIds {
        request_id: 77,
        count: u32::MAX,
    }));
    game.flush().await;
    let e = game.expect_error().await;
    assert_eq!((e.code, e.fatal), (ErrorCode::InvalidValue as i32, false));
    assert!(e.detail.contains("4294967295"), "{}", e.detail);
    assert_eq!(game.reserve(0).await, Vec::<u64>::new());
    assert!(game.reserve(1).await[0] > *b.last().unwrap());
}

#[tokio::test]
async fn a_unix_socket_serves_the_game() {
    let dir = std::env::temp_dir().join(format!("cellmesh-sidecar-unix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("game.sock");
    // A stale socket file from a dead sidecar does not stop a new one.
    std::fs::write(&path, b"").unwrap();
    let cfg = cellmesh_sidecar::SidecarConfig {
        local_listen: format!("unix:{}", path.display()),
        ..test_config()
    };
    let sc = TestSidecar::start_with(cfg).await;
    assert_eq!(sc.local(), format!("unix:{}", path.display()));
    let mut game = sc.game().await;
    assert_eq!(game.welcome.node_id, 7);
    assert_eq!(game.reserve(3).await.len(), 3);
    sc.shutdown().await;
    assert!(!path.exists(), "the socket file is removed on shutdown");
}

#[tokio::test]
async fn bad_config_and_busy_ports_are_named() {
    let bad = cellmesh_sidecar::SidecarConfig {
        view_radius_chunks: 0,
        ..test_config()
    };
    let err = cellmesh_sidecar::start(
        bad,
        cellmesh_stores::Stores::in_memory(),
        Default::default(),
    )
    .await
    .err()
    .unwrap();
    assert!(format!("{err:#}").contains("view_radius_chunks"), "{err:#}");
    let sc = TestSidecar::start().await;
    let busy = cellmesh_sidecar::SidecarConfig {
        mesh_listen: sc.mesh().to_string(),
        ..test_config()
    };
    let err = cellmesh_sidecar::start(
        busy,
        cellmesh_stores::Stores::in_memory(),
        Default::default(),
    )
    .await
    .err()
    .unwrap();
    assert!(
        format!("{err:#}").contains(&format!("mesh_listen {}", sc.mesh())),
        "{err:#}"
    );
}

#[tokio::test]
async fn attach_registers_and_detach_saves_and_releases() {
    let mut s = Scene::new().await;
    let attached = s.edge.login(1, "alice").await;
    assert_eq!(
        (attached.account.as_str(), attached.gateway_node),
        ("alice", 7)
    );
    assert_eq!(
        (attached.world_width, attached.chunk_size),
        (131_072.0, 32.0)
    );
    let entry =
        s.sc.stores
            .directory
            .lookup("alice")
            .await
            .unwrap()
            .expect("registered");
    assert_eq!(
        (entry.gateway_node, entry.session_epoch),
        (7, attached.session_epoch)
    );
    let join = s.game.expect_join("alice").await;
    assert!(join.last_position.is_none(), "a new player has no record");

    let me = s.id();
    s.game.push(avatar(me, "alice", chunk(10, 20), vec![]));
    s.game.push(move_to(me, chunk(11, 20)));
    s.tick().await;
    s.edge.batch(1).await;
    s.sc.state_until("alice in /state", |st| st["sessions"][0]["master_id"] == me)
        .await;
    // The proxy reports the round trip its pings measure once the client answers one.
    let st = within("the proxy's rtt report in /state", async {
        loop {
            s.edge.player(1).pump(Duration::from_millis(100)).await;
            let st = s.sc.state().await;
            if st["sessions"][0]["rtt_ms_p50"].is_number() {
                return st;
            }
        }
    })
    .await;
    let (p50, min) = (
        st["sessions"][0]["rtt_ms_p50"].as_f64().unwrap(),
        st["sessions"][0]["rtt_ms_min"].as_f64().unwrap(),
    );
    assert!((0.0..1000.0).contains(&min) && min <= p50, "{p50} {min}");
    assert_eq!(st["sessions"][0]["view_chunks"], 121);
    assert_eq!(st["sessions"][0]["epoch"], attached.session_epoch);
    assert_eq!(st["links"][0]["proxy"], "edge-test");

    s.edge.leave(1).await;
    let leave = s
        .game
        .expect("PlayerLeave", |m| match m {
            sidecar_message::Body::PlayerLeave(l) => Some(l.clone()),
            _ => None,
        })
        .await;
    assert_eq!(
        (leave.account.as_str(), leave.session_epoch),
        ("alice", attached.session_epoch)
    );
    assert!(leave.reason.contains("bye"), "{}", leave.reason);
    let record = within("the record to be saved", async {
        loop {
            if let Some(r) = s.sc.stores.players.load("alice").await.unwrap() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(
        record.last_position,
        Some([11.0 * CHUNK + 16.0, 20.0 * CHUNK + 16.0, 0.0])
    );
    assert_eq!(record.home_geo, "local");
    assert!(
        s.sc.stores
            .directory
            .lookup("alice")
            .await
            .unwrap()
            .is_none(),
        "released"
    );

    // The next login starts where the player left, with a higher epoch.
    let again = s.edge.login(2, "alice").await;
    assert!(again.session_epoch > attached.session_epoch);
    let join = s.game.expect_join("alice").await;
    assert_eq!(
        join.last_position.map(|p| (p.x, p.y)),
        Some((11.0 * CHUNK + 16.0, 20.0 * CHUNK + 16.0))
    );
}

#[tokio::test]
async fn the_player_record_seeds_the_join() {
    let mut s = Scene::new().await;
    let record = PlayerRecord {
        account: "bob".into(),
        last_position: Some([100.0, 200.0, 3.0]),
        home_geo: "eu".into(),
        updated_unix_ms: 1,
        // A session in another geo's directory, which counts epochs on its own.
        session_epoch: 5_000,
        ..PlayerRecord::default()
    };
    s.sc.stores.players.save(&record).await.unwrap();
    let attached = s.edge.login(1, "bob").await;
    let join = s.game.expect_join("bob").await;
    let p = join.last_position.unwrap();
    assert_eq!((p.x, p.y, p.z), (100.0, 200.0, 3.0));
    assert!(
        attached.session_epoch > 5_000,
        "the new session goes above the record's: {}",
        attached.session_epoch
    );
    assert_eq!(
        metric(&s.sc.metrics().await, "login_record_reads_total"),
        1.0
    );
}

/// The value of an unlabelled sample in a metrics page.
fn metric(page: &str, name: &str) -> f64 {
    let full = format!("cellmesh_sidecar_{name} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&full))
        .unwrap_or_else(|| panic!("no {full} in\n{page}"))
        .trim()
        .parse()
        .unwrap()
}

/// A hint older than what this geo already holds (a later session of the account registered
/// here and saved the record since) does not rewind the record: the record is read and used,
/// and the login registers above it. Before, the hint's position replaced it.
#[tokio::test]
async fn a_hint_older_than_the_player_record_does_not_rewind_it() {
    let mut s = Scene::new().await;
    let dir = s.sc.stores.directory.clone();
    let mut later = 0;
    for _ in 0..10 {
        later = dir
            .register("bob", 9, Duration::from_secs(30))
            .await
            .unwrap();
    }
    dir.release("bob", later).await.unwrap();
    let newer = PlayerRecord {
        account: "bob".into(),
        last_position: Some([1.0, 1.0, 0.0]),
        session_epoch: later,
        ..PlayerRecord::default()
    };
    s.sc.stores.players.save(&newer).await.unwrap();
    // A proxy's attach carrying a handover hint, as the proxy of a handover writes it.
    let mut proxy = RawPeer::proxy(s.sc.mesh(), "edge-handover").await;
    proxy
        .send(mesh_message::Body::Attach(mesh::Attach {
            session_id: 1,
            account: "bob".into(),
            remote_addr: "127.0.0.1:1".into(),
            handover: Some(mesh::HandoverHint {
                session_epoch: later - 5,
                last_position: Some(mesh::MeshVec3 {
                    x: 300.0,
                    y: 400.0,
                    z: 0.0,
                }),
                issued_unix_ms: 1,
                source: "cookie".into(),
            }),
            attestation: attestation("bob", 1),
            ..Default::default()
        }))
        .await;
    let attached = proxy
        .expect("Attached", |m| match m {
            mesh_message::Body::Attached(a) => Some(*a),
            _ => None,
        })
        .await;
    assert!(attached.session_epoch > later, "{}", attached.session_epoch);
    let p = s.game.expect_join("bob").await.last_position.unwrap();
    assert_eq!(
        (p.x, p.y),
        (1.0, 1.0),
        "the record's position, not the hint's"
    );
    let page = s.sc.metrics().await;
    assert_eq!(metric(&page, "login_record_reads_total"), 1.0);
    assert_eq!(metric(&page, "login_hints_stale_total"), 1.0);
}

#[tokio::test]
async fn a_login_handed_over_from_another_geo_skips_the_record_read() {
    let mut s = Scene::new().await;
    // MongoDB says otherwise: the hint wins, and the record is not even read.
    let stale = PlayerRecord {
        account: "bob".into(),
        last_position: Some([1.0, 1.0, 0.0]),
        ..PlayerRecord::default()
    };
    s.sc.stores.players.save(&stale).await.unwrap();
    // A proxy's attach carrying a handover hint, as the proxy of a handover writes it.
    let mut proxy = RawPeer::proxy(s.sc.mesh(), "edge-handover").await;
    proxy
        .send(mesh_message::Body::Attach(mesh::Attach {
            session_id: 1,
            account: "bob".into(),
            remote_addr: "127.0.0.1:1".into(),
            moved: false,
            moved_from_epoch: 0,
            handover: Some(mesh::HandoverHint {
                session_epoch: 7_000,
                last_position: Some(mesh::MeshVec3 {
                    x: 300.0,
                    y: 400.0,
                    z: 0.0,
                }),
                issued_unix_ms: 1,
                source: "cookie".into(),
            }),
            attestation: attestation("bob", 1),
        }))
        .await;
    let attached = proxy
        .expect("Attached", |m| match m {
            mesh_message::Body::Attached(a) => Some(*a),
            _ => None,
        })
        .await;
    assert!(attached.session_epoch > 7_000, "{}", attached.session_epoch);
    let p = s.game.expect_join("bob").await.last_position.unwrap();
    assert_eq!((p.x, p.y), (300.0, 400.0));
    let page = s.sc.metrics().await;
    assert_eq!(metric(&page, "login_record_reads_total"), 0.0);
    assert!(
        page.contains("cellmesh_sidecar_login_hints_total{kind=\"cookie\"} 1"),
        "{page}"
    );

    // Handed over again: the record saved says where the session went and when.
    proxy
        .send(mesh_message::Body::Detach(mesh::Detach {
            session_id: 1,
            kick_reason: KickReason::Transferred as u32,
            detail: "handed over to geo paris".into(),
            retry_after_ms: 0,
        }))
        .await;
    let players = s.sc.stores.players.clone();
    let saved = cellmesh_test_support::within("the record is saved", async {
        loop {
            if let Some(r) = players.load("bob").await.unwrap() {
                if r.last_handover_unix_ms.is_some() {
                    return r;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(saved.session_epoch, attached.session_epoch);
    assert_eq!(saved.gateway_geo, s.sc.cfg.geo);
}

#[tokio::test]
async fn a_second_login_displaces_the_first() {
    let mut s = Scene::new().await;
    // The first session's proxy is a raw link: its input and Detach for the session after the
    // sidecar displaced it (a proxy's frames crossing the sidecar's Detach) are on the wire.
    let mut old = RawPeer::proxy(s.sc.mesh(), "edge-old").await;
    old.send(mesh_message::Body::Attach(mesh::Attach {
        session_id: 1,
        account: "alice".into(),
        remote_addr: "127.0.0.1:1".into(),
        attestation: attestation("alice", 1),
        ..Default::default()
    }))
    .await;
    let old_epoch = old
        .expect("Attached", |m| match m {
            mesh_message::Body::Attached(a) => Some(a.session_epoch),
            _ => None,
        })
        .await;
    assert_eq!(s.game.expect_join("alice").await.session_epoch, old_epoch);
    let me = s.id();
    let inventory = comp(7, "sword", aud(AudienceKind::OwnerOnly, &[]));
    s.game
        .push(avatar(me, "alice", chunk(100, 100), vec![inventory]));
    s.tick().await;
    old.expect("the old session's first batch", |m| match m {
        mesh_message::Body::ToClient(t) if t.session_id == 1 => Some(()),
        _ => None,
    })
    .await;
    let first =
        s.sc.stores
            .directory
            .lookup("alice")
            .await
            .unwrap()
            .unwrap()
            .session_epoch;
    assert_eq!(first, old_epoch);
    // The same account through a real proxy.
    let attached = s.edge.login(5, "alice").await;
    assert!(attached.session_epoch > first);
    let kicked = old.expect_detach(1).await;
    assert_eq!(kicked.kick_reason, KickReason::Displaced as u32);
    // The game hears a new PlayerJoin with the new epoch, and no PlayerLeave.
    let join = s.game.expect_join("alice").await;
    assert_eq!(join.session_epoch, attached.session_epoch);
    let seen = s.game.drain(QUIET).await;
    assert!(
        !seen
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(_))),
        "{seen:?}"
    );
    // The new session is shown the world (its own avatar, inventory included) at the next tick.
    s.tick().await;
    let b = s.edge.batch(5).await;
    assert_eq!(kinds(&b), [(me, DeltaKind::Appear)]);
    assert_eq!(types(&b.deltas[0]), [1, 7]);
    // The old session is gone: its input is dropped, the new one's reaches the game.
    old.send(mesh_message::Body::Input(mesh::SessionInput {
        session_id: 1,
        seq: 1,
        payload: "old".into(),
    }))
    .await;
    s.edge.input(5, 1, b"new").await;
    let i = s.game.expect_input().await;
    assert_eq!(
        (i.payload.as_ref(), i.session_epoch),
        (&b"new"[..], attached.session_epoch)
    );
    assert_eq!(s.sc.h().stats().sessions, 1);
    // A late Detach of the old session changes nothing.
    old.send(mesh_message::Body::Detach(mesh::Detach {
        session_id: 1,
        kick_reason: KickReason::KickUnspecified as u32,
        detail: "bye".into(),
        retry_after_ms: 0,
    }))
    .await;
    s.edge.input(5, 2, b"still").await;
    s.game
        .expect("Input 2", |m| match m {
            sidecar_message::Body::Input(i) if i.seq == 2 => Some(()),
            _ => None,
        })
        .await;
    // Nor did the old session's input come later: the two proxies' links are not ordered.
    let rest = s.game.drain(QUIET).await;
    assert!(
        !rest
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::Input(i) if i.payload == "old")),
        "{rest:?}"
    );
    assert!(s
        .sc
        .stores
        .directory
        .lookup("alice")
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn a_game_restart_keeps_the_sessions() {
    let mut s = Scene::new().await;
    let (me, _) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    let epoch =
        s.sc.stores
            .directory
            .lookup("alice")
            .await
            .unwrap()
            .unwrap()
            .session_epoch;
    s.game.tx.close().await.unwrap();
    let b = s.edge.batch(1).await;
    assert_eq!(kinds(&b), [(me, DeltaKind::Vanish)]);
    assert_eq!(s.sc.h().stats().sessions, 1);
    s.game = s.sc.game().await;
    let join = s.game.expect_join("alice").await;
    assert_eq!(join.session_epoch, epoch);
    assert!(join.last_position.is_some());
    // The avatar had no checkpoint: the new game spawns it again, and until it has, the
    // player's input has nothing to apply to. It is dropped and counted, not handed over.
    s.edge.input(1, 1, b"too early").await;
    let respawning = "cellmesh_sidecar_inputs_dropped_total{reason=\"input_avatar_respawning\"} 1";
    within("the early input counted", async {
        while !s.sc.metrics().await.lines().any(|l| l == respawning) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let again = s.game.reserve(1).await[0];
    s.game
        .push(avatar(again, "alice", join.last_position.unwrap(), vec![]));
    s.tick().await;
    let b = s.edge.batch(1).await;
    assert!(kinds(&b).contains(&(again, DeltaKind::Appear)), "{b:?}");
    s.edge.input(1, 2, b"hello again").await;
    let i = s.game.expect_input().await;
    assert_eq!((i.seq, i.payload.as_ref()), (2, &b"hello again"[..]));
}

#[tokio::test]
async fn link_handshake_rules() {
    let sc = TestSidecar::start().await;
    let refused = |frame: MeshFrame| {
        let addr = sc.mesh();
        async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (r, w) = stream.into_split();
            let mut rx = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
            let mut tx = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
            tx.send(frame).await.unwrap();
            let got = within("LinkRefused", rx.next()).await.unwrap().unwrap();
            assert!(within("close", rx.next()).await.is_none());
            match got.messages.into_iter().next().and_then(|m| m.body) {
                Some(mesh_message::Body::Refused(r)) => r.reason,
                other => panic!("expected LinkRefused, got {other:?}"),
            }
        }
    };
    assert_eq!(
        refused(link_hello("edge-9", 2)).await,
        format!(
            "peer \"edge-9\" speaks protocol 2.0, sidecar speaks {}.{}",
            cellmesh_proto::PROTOCOL_MAJOR,
            cellmesh_proto::PROTOCOL_MINOR
        )
    );
    let mut as_sidecar = link_hello("node-3", 1);
    if let Some(mesh_message::Body::Hello(h)) = &mut as_sidecar.messages[0].body {
        h.role = PeerRole::Sidecar as i32;
        h.node_id = 1000;
    }
    assert!(refused(as_sidecar)
        .await
        .contains("only the lower node id dials"));
    let attach_first = MeshFrame::one(mesh_message::Body::Attach(mesh::Attach {
        session_id: 1,
        account: "x".into(),
        remote_addr: String::new(),
        moved: false,
        moved_from_epoch: 0,
        handover: None,
        attestation: attestation("x", 1),
    }));
    assert!(refused(attach_first).await.contains("expected LinkHello"));

    let peer = RawPeer::proxy(sc.mesh(), "edge-ok").await;
    assert_eq!(peer.hello.role, PeerRole::Sidecar as i32);
    assert_eq!((peer.hello.id.as_str(), peer.hello.node_id), ("7", 7));
    assert_eq!(peer.hello.version.unwrap().major, 1);
}

#[tokio::test]
async fn a_silent_link_dies_and_its_sessions_leave() {
    let mut s = Scene::new().await;
    // A link that says hello, attaches, then goes quiet (no heartbeats).
    let stream = tokio::net::TcpStream::connect(s.sc.mesh()).await.unwrap();
    let (r, w) = stream.into_split();
    let mut rx = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
    let mut tx = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
    tx.send(link_hello("edge-quiet", 1)).await.unwrap();
    tx.send(MeshFrame::one(mesh_message::Body::Attach(mesh::Attach {
        session_id: 1,
        account: "quiet".into(),
        remote_addr: String::new(),
        moved: false,
        moved_from_epoch: 0,
        handover: None,
        attestation: attestation("quiet", 1),
    })))
    .await
    .unwrap();
    s.game.expect_join("quiet").await;
    // Meanwhile a healthy link keeps its session.
    let (_, _) = s.join(2, "alice", chunk(100, 100), vec![]).await;
    // Not before the dead-link timeout (5 s after its last frame)...
    let early = s.game.drain(Duration::from_secs(3)).await;
    assert!(
        !early
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(_))),
        "{early:?}"
    );
    // ...but soon after it.
    let leave = s
        .game
        .expect("PlayerLeave", |m| match m {
            sidecar_message::Body::PlayerLeave(l) => Some(l.clone()),
            _ => None,
        })
        .await;
    assert_eq!(leave.account, "quiet");
    // The sidecar heartbeated the quiet link, then closed it.
    let mut beats = 0;
    while let Some(Ok(f)) = rx.next().await {
        beats += f
            .messages
            .iter()
            .filter(|m| matches!(m.body, Some(mesh_message::Body::Heartbeat(_))))
            .count();
    }
    assert!(beats >= 3, "{beats} heartbeats");
    assert!(s
        .sc
        .metrics()
        .await
        .contains("cellmesh_sidecar_errors_total{kind=\"link_timeout\"} 1"));
    // The healthy session is untouched.
    s.edge.input(2, 1, b"fine").await;
    s.game
        .expect("alice's input", |m| match m {
            sidecar_message::Body::Input(i) if i.account == "alice" => Some(()),
            _ => None,
        })
        .await;
    assert_eq!(s.sc.h().stats().sessions, 1);
}

#[tokio::test]
async fn a_link_that_stops_reading_is_closed_without_stalling_the_node() {
    let cfg = cellmesh_sidecar::SidecarConfig {
        link_outbox_frames: 4,
        ..test_config()
    };
    let mut s = Scene::with(TestSidecar::start_with(cfg).await).await;
    // The slow proxy: attaches a session, heartbeats, never reads.
    let stream = tokio::net::TcpStream::connect(s.sc.mesh()).await.unwrap();
    let (_r, w) = stream.into_split();
    let mut tx = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
    tx.send(link_hello("edge-slow", 1)).await.unwrap();
    tx.send(MeshFrame::one(mesh_message::Body::Attach(mesh::Attach {
        session_id: 1,
        account: "slow".into(),
        remote_addr: String::new(),
        moved: false,
        moved_from_epoch: 0,
        handover: None,
        attestation: attestation("slow", 1),
    })))
    .await
    .unwrap();
    s.game.expect_join("slow").await;
    let (_, _) = s.join(2, "alice", chunk(100, 100), vec![]).await;
    let slow = s.id();
    let big = Bytes::from(vec![b'x'; 200_000]);
    s.game.push(Body::Spawn(cellmesh_proto::local::Spawn {
        entity_id: slow,
        position: Some(chunk(300, 300)),
        owner_account: "slow".into(),
        is_master: true,
        ..Default::default()
    }));
    s.tick().await;
    // Big updates for the slow session every tick, until its link is closed; its avatar leaves
    // once the session's grace passed with no newer session (the proxy would have moved it).
    let leave = within("the slow link to be closed", async {
        loop {
            s.game.push(change(
                slow,
                cellmesh_proto::local::Component {
                    r#type: 2,
                    payload: big.clone(),
                    audience: aud(AudienceKind::PublicInRange, &[]),
                },
            ));
            s.tick().await;
            let left = s.game.drain(Duration::from_millis(5)).await;
            if let Some(l) = left.into_iter().find_map(|m| match m {
                sidecar_message::Body::PlayerLeave(l) => Some(l),
                _ => None,
            }) {
                return l;
            }
        }
    })
    .await;
    assert_eq!(leave.account, "slow");
    assert!(leave.reason.contains("outbox full"), "{}", leave.reason);
    assert!(s
        .sc
        .metrics()
        .await
        .contains("cellmesh_sidecar_errors_total{kind=\"link_outbox_full\"} 1"));
    // The healthy link still gets its batches.
    s.edge.settle(QUIET).await;
    let n = s.id();
    s.game.push(npc(n, chunk(101, 100)));
    s.tick().await;
    assert_eq!(kinds(&s.edge.batch(2).await), [(n, DeltaKind::Appear)]);
    tx.send(MeshFrame::one(mesh_message::Body::Heartbeat(
        mesh::Heartbeat { sent_unix_ms: 0 },
    )))
    .await
    .ok();
}

#[tokio::test]
async fn shutdown_detaches_sessions_and_closes_the_game_cleanly() {
    let mut s = Scene::new().await;
    let (_, _) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    let admin = s.sc.h().admin.clone();
    assert!(admin.is_ready());
    s.sc.stop.cancel();
    let kick = s.edge.kicked(1).await;
    assert_eq!(kick.reason, KickReason::Shutdown as i32);
    let rest = s.game.closed().await;
    assert!(
        rest.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(l) if l.account == "alice")),
        "{rest:?}"
    );
    assert!(!admin.is_ready());
    within("wait", s.sc.handle.take().unwrap().wait()).await;
    let record =
        s.sc.stores
            .players
            .load("alice")
            .await
            .unwrap()
            .expect("saved on shutdown");
    assert!(record.last_position.is_some());
}
