//! The core driven by hand, input by input, as the driver would.

use std::sync::Arc;

use cellmesh_proto::local::{self, game_message, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, NodeId, Partition};

use super::*;

const ME: NodeId = 1;
const GATEWAY: NodeId = 2;
const AVATAR: u64 = 7;

/// Node 1 of two on 16 x 16 chunks of 32 m: node 1 owns x 0..256 m, node 2 the rest.
fn node() -> Core {
    leased_node(None)
}

/// The same node, writing under `lease`.
fn leased_node(lease: Option<LeaseTerms>) -> Core {
    configured_node(lease, |_| {})
}

/// The same node, its configuration changed by `tweak`.
fn configured_node(lease: Option<LeaseTerms>, tweak: impl FnOnce(&mut SidecarConfig)) -> Core {
    node_with_game_of(lease, tweak, super::pair_tests::FREEZING_GAME)
}

/// The same node, its game speaking the current protocol: it releases what it hands over,
/// avatars included, and is asked to (`Offload`).
fn releasing_node() -> Core {
    node_with_game_of(
        None,
        |c| c.handoff_offload = true,
        local::ProtocolVersion::current(),
    )
}

/// The same node, its game speaking protocol `version`.
fn node_with_game_of(
    lease: Option<LeaseTerms>,
    tweak: impl FnOnce(&mut SidecarConfig),
    version: local::ProtocolVersion,
) -> Core {
    let world = WorldShape {
        width: 512.0,
        height: 512.0,
        chunk_size: 32.0,
        region_size: 256.0,
    };
    let grid = Grid::even(&world, 2, 1, &[ME, GATEWAY]).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
    let mut cfg = SidecarConfig {
        node_id: ME,
        world,
        ..SidecarConfig::default()
    };
    tweak(&mut cfg);
    let mut core = Core::new(
        Arc::new(cfg),
        Metrics::default(),
        Arc::new(partition),
        true,
        lease,
        at(0),
    );
    core.handle(
        at(0),
        Input::GameHello {
            conn: 1,
            hello: local::Hello {
                version: Some(version),
                tick_rate_hz: 20,
                game: "test".into(),
            },
            rest: vec![],
        },
    );
    core
}

fn at(ms: u64) -> Now {
    Now {
        mono_ms: ms,
        unix_ms: 1_700_000_000_000 + ms,
    }
}

/// What a proxy holding the built-in attest key signs for `account`'s session at `ms`.
fn attested(account: &str, session_id: u64, ms: u64) -> String {
    let ring = crate::config::SidecarConfig::default()
        .attest_ring()
        .unwrap();
    cellmesh_proto::attest::sign(ring.signing(), account, session_id, at(ms).unix_ms)
}

fn link_up(core: &mut Core, ms: u64, link: LinkId, node: NodeId) {
    link_up_as(core, ms, link, node, 1);
}

/// Peer `node`'s link up from the process holding its lease under `lease_epoch`.
fn link_up_as(core: &mut Core, ms: u64, link: LinkId, node: NodeId, lease_epoch: u64) {
    core.handle(
        at(ms),
        Input::LinkUp {
            link,
            hello: mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: mesh::PeerRole::Sidecar as i32,
                id: node.to_string(),
                geo: "test".into(),
                partition_epoch: 1,
                node_id: node,
                lease_epoch,
                ..Default::default()
            },
            remote: format!("node-{node}"),
            rest: vec![],
        },
    );
}

fn game_tick(core: &mut Core, ms: u64, tick: u64, body: game_message::Body) {
    core.handle(
        at(ms),
        Input::GameFrame {
            conn: 1,
            messages: vec![
                body.into(),
                game_message::Body::TickEnd(local::TickEnd { tick }).into(),
            ],
        },
    );
}

/// The anchors queued for `link`, as (entity, x, y).
fn anchors(core: &mut Core, link: LinkId) -> Vec<(u64, f64, f64)> {
    let mut found = Vec::new();
    while let Some(out) = core.poll_output() {
        let Output::ToLink { link: l, frame } = out else {
            continue;
        };
        for m in frame.messages {
            if let (true, Some(mesh_message::Body::Anchor(a))) = (l == link, m.body) {
                let p = a.position.unwrap_or_default();
                found.push((a.entity_id, p.x, p.y));
            }
        }
    }
    found
}

/// The game spawns `id` at `at` in tick `tick` (no owner).
fn spawn(core: &mut Core, ms: u64, tick: u64, id: u64, at: Option<local::Vec3>) {
    game_tick(
        core,
        ms,
        tick,
        game_message::Body::Spawn(local::Spawn {
            entity_id: id,
            position: at,
            ..Default::default()
        }),
    );
}

fn pos(x: f64, y: f64) -> Option<local::Vec3> {
    Some(local::Vec3 { x, y, z: 0.0 })
}

/// cuts seed 586, overload seed 451, geos seed 586: a gateway's client saw entities (its own
/// avatar among them) vanish from well inside its view, because the view stood where the avatar
/// was when the owner's link to the gateway went down. The owner re-anchored the gateway only at
/// the avatar's next change after the link came back, and then after the gones of that tick.
#[test]
fn a_gateway_is_reanchored_as_soon_as_its_link_is_back() {
    let mut core = node();
    link_up(&mut core, 10, 10, GATEWAY);
    core.handle(
        at(20),
        Input::LinkFrame {
            link: 10,
            messages: vec![mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                account: "p".into(),
                session_epoch: 1,
                last_position: None,
                gateway_node: 0,
                hops: 0,
            })
            .into()],
        },
    );
    game_tick(
        &mut core,
        50,
        1,
        game_message::Body::Spawn(local::Spawn {
            entity_id: AVATAR,
            position: pos(40.0, 40.0),
            owner_account: "p".into(),
            is_master: true,
            ..Default::default()
        }),
    );
    assert_eq!(anchors(&mut core, 10), vec![(AVATAR, 40.0, 40.0)]);

    // The avatar walks two chunks on while the gateway cannot hear it, then stands still.
    core.handle(
        at(60),
        Input::LinkClosed {
            link: 10,
            reason: "cut".into(),
        },
    );
    game_tick(
        &mut core,
        100,
        2,
        game_message::Body::Update(local::Update {
            entity_id: AVATAR,
            position: pos(100.0, 40.0),
            ..Default::default()
        }),
    );
    assert_eq!(anchors(&mut core, 10), vec![]);

    link_up(&mut core, 200, 11, GATEWAY);
    assert_eq!(anchors(&mut core, 11), vec![(AVATAR, 100.0, 40.0)]);
}

fn lease_of_me() -> Lease {
    Lease {
        node: ME,
        holder: "test".into(),
        epoch: 1,
        expires_unix_ms: u64::MAX,
        ids_floor_unix_ms: 0,
    }
}

fn renewed(until_ms: u64) -> Input {
    Input::LeaseRenewed(LeaseTerms {
        lease: lease_of_me(),
        until_ms,
    })
}

#[test]
fn a_node_stops_writing_at_its_lease_deadline_unless_a_renewal_lands() {
    let mut core = leased_node(Some(LeaseTerms {
        lease: lease_of_me(),
        until_ms: 1_000,
    }));
    assert!(
        core.poll_timeout().unwrap() <= 1_000,
        "a timer wakes it then"
    );
    core.handle(at(999), Input::Timer);
    assert_eq!(core.state()["lease_live"], true);
    // A renewal moves the deadline; an older answer arriving late cannot move it back.
    core.handle(at(999), renewed(2_000));
    core.handle(at(999), renewed(1_500));
    core.handle(at(1_999), Input::Timer);
    assert_eq!(core.state()["lease_live"], true);
    core.handle(at(2_000), Input::Timer);
    assert_eq!(core.state()["lease_live"], false);
    assert_eq!(core.state()["lease_lost"], false);
    // Lapsed, not lost: the lease taken back under its epoch (a store that answered late)
    // lets it write again until its new deadline.
    core.handle(at(2_001), renewed(5_000));
    core.handle(at(2_002), Input::Timer);
    assert_eq!(core.state()["lease_live"], true);
    // Lost is lost (another grant replaced it): a renewal that lands now changes nothing.
    core.handle(at(2_003), Input::LeaseLost);
    assert_eq!(core.state()["lease_lost"], true);
    core.handle(at(2_004), renewed(9_000));
    core.handle(at(2_005), Input::Timer);
    assert_eq!(core.state()["lease_live"], false);
    assert!(core.lease_lost());
}

/// The store stops answering past the lease's deadline, then answers again with the lease
/// still this process's (a MongoDB election): frozen meanwhile, thawed after, never exited.
#[test]
fn a_lapsed_lease_freezes_what_the_node_owns_until_it_is_taken_back() {
    let mut core = node();
    core.handle(at(0), renewed(1_000));
    spawn(&mut core, 50, 1, AVATAR, pos(40.0, 40.0));
    to_game(&mut core);
    core.handle(at(1_000), Input::Timer);
    let frozen: Vec<u64> = to_game(&mut core)
        .into_iter()
        .filter_map(|m| match m {
            sidecar_message::Body::Freeze(f) => Some(f.entity_id),
            _ => None,
        })
        .collect();
    assert_eq!(frozen, vec![AVATAR]);
    assert_eq!(core.state()["lease_live"], false);
    assert!(core.reals().iter().all(|r| r.frozen));
    // The game answers its Freeze, and writes nothing more; a new entity is frozen at birth.
    game_tick(
        &mut core,
        1_050,
        2,
        game_message::Body::Snapshot(local::Snapshot {
            entity_id: AVATAR,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"avatar"),
        }),
    );
    spawn(&mut core, 1_100, 3, 9, pos(60.0, 40.0));
    let out = to_game(&mut core);
    assert!(
        out.iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == 9)),
        "{out:?}"
    );
    assert!(
        !out.iter()
            .any(|m| matches!(m, sidecar_message::Body::Error(_))),
        "{out:?}"
    );
    // The lease is taken back: both thaw, and the node writes again; it never exits.
    core.handle(at(1_500), renewed(3_000));
    let mut thawed: Vec<u64> = to_game(&mut core)
        .into_iter()
        .filter_map(|m| match m {
            sidecar_message::Body::Thaw(t) if t.reason.contains("lease is back") => {
                Some(t.entity_id)
            }
            _ => None,
        })
        .collect();
    thawed.sort_unstable();
    assert_eq!(thawed, vec![AVATAR, 9]);
    assert_eq!(core.state()["lease_live"], true);
    assert!(core.reals().iter().all(|r| !r.frozen));
    assert!(!core.lease_lost());
    let exited =
        std::iter::from_fn(|| core.poll_output()).any(|o| matches!(o, Output::Exit { .. }));
    assert!(!exited);
}

/// Everything queued for the game, in order.
fn to_game(core: &mut Core) -> Vec<sidecar_message::Body> {
    let mut found = Vec::new();
    while let Some(out) = core.poll_output() {
        if let Output::ToGame { frame, .. } = out {
            found.extend(frame.messages.into_iter().filter_map(|m| m.body));
        }
    }
    found
}

fn hello(core: &mut Core, ms: u64, conn: ConnId) {
    core.handle(
        at(ms),
        Input::GameHello {
            conn,
            hello: local::Hello {
                version: Some(super::pair_tests::FREEZING_GAME),
                tick_rate_hz: 20,
                game: "test".into(),
            },
            rest: vec![],
        },
    );
}

#[test]
fn a_game_that_comes_back_within_its_grace_gets_its_entities_from_their_checkpoints() {
    const NPC: u64 = 8;
    let mut core = node();
    spawn(&mut core, 50, 1, AVATAR, pos(40.0, 40.0));
    spawn(&mut core, 60, 2, NPC, pos(50.0, 40.0));
    // The avatar's checkpoint is asked for within an interval and answered; the NPC's answer
    // never comes.
    let mut asked = Vec::new();
    for ms in (100..=2_100).step_by(100) {
        core.handle(at(ms), Input::Timer);
        for m in to_game(&mut core) {
            if let sidecar_message::Body::Checkpoint(c) = m {
                asked.extend(c.entity_ids);
            }
        }
    }
    assert!(asked.contains(&AVATAR) && asked.contains(&NPC), "{asked:?}");
    game_tick(
        &mut core,
        2_150,
        3,
        game_message::Body::CheckpointState(local::CheckpointState {
            entity_id: AVATAR,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"avatar"),
        }),
    );
    // A stale answer (another epoch) is not kept.
    game_tick(
        &mut core,
        2_160,
        4,
        game_message::Body::CheckpointState(local::CheckpointState {
            entity_id: NPC,
            entity_epoch: 9,
            state: bytes::Bytes::from_static(b"npc"),
        }),
    );

    core.handle(
        at(3_000),
        Input::GameClosed {
            conn: 1,
            reason: "crashed".into(),
        },
    );
    core.handle(at(3_100), Input::Timer);
    assert_eq!(core.reals().len(), 2, "kept for the game's return");
    hello(&mut core, 4_000, 2);
    let back = to_game(&mut core);
    let adopts: Vec<(u64, u64, &[u8])> = back
        .iter()
        .filter_map(|m| match m {
            sidecar_message::Body::Adopt(a) => Some((a.entity_id, a.entity_epoch, &a.state[..])),
            _ => None,
        })
        .collect();
    assert_eq!(adopts, vec![(AVATAR, 1, &b"avatar"[..])]);
    // The NPC had no checkpoint: despawned, not resurrected from nothing.
    assert_eq!(
        core.reals().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![AVATAR]
    );
    core.handle(
        at(4_050),
        Input::GameFrame {
            conn: 2,
            messages: vec![game_message::Body::Adopted(local::Adopted {
                entity_id: AVATAR,
                entity_epoch: 1,
            })
            .into()],
        },
    );
    assert_eq!(core.metrics().restored.get(), 1);
}

#[test]
fn a_game_that_does_not_come_back_in_time_loses_its_entities() {
    let mut core = node();
    spawn(&mut core, 50, 1, AVATAR, pos(40.0, 40.0));
    core.handle(
        at(100),
        Input::GameClosed {
            conn: 1,
            reason: "crashed".into(),
        },
    );
    let grace = SidecarConfig::default().game_grace_ms;
    core.handle(at(100 + grace - 1), Input::Timer);
    assert_eq!(core.reals().len(), 1);
    core.handle(at(100 + grace + 100), Input::Timer);
    assert!(core.reals().is_empty());
    // A game that connects now starts from nothing.
    hello(&mut core, 100 + grace + 200, 2);
    assert!(!to_game(&mut core)
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::Adopt(_))));
}

/// The store requests queued so far.
fn store_requests(core: &mut Core) -> Vec<StoreRequest> {
    let mut found = Vec::new();
    while let Some(out) = core.poll_output() {
        if let Output::Store(r) = out {
            found.push(r);
        }
    }
    found
}

/// A proxy link (20) comes up with an `Attach` of `account`'s session 1 (handed over from another
/// geo with `handover`).
fn proxy_attaches(core: &mut Core, ms: u64, account: &str, handover: Option<mesh::HandoverHint>) {
    proxy_of_geo_attaches(core, ms, account, handover, "test");
}

/// [`proxy_attaches`] from a proxy of `geo`.
fn proxy_of_geo_attaches(
    core: &mut Core,
    ms: u64,
    account: &str,
    handover: Option<mesh::HandoverHint>,
    geo: &str,
) {
    core.handle(
        at(ms),
        Input::LinkUp {
            link: 20,
            hello: mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: mesh::PeerRole::Proxy as i32,
                id: "edge".into(),
                geo: geo.into(),
                partition_epoch: 0,
                node_id: 0,
                lease_epoch: 0,
                ..Default::default()
            },
            remote: "edge".into(),
            rest: vec![mesh_message::Body::Attach(mesh::Attach {
                session_id: 1,
                account: account.into(),
                remote_addr: String::new(),
                moved: false,
                moved_from_epoch: 0,
                handover,
                attestation: attested(account, 1, ms),
            })
            .into()],
        },
    );
}

/// A proxy link (20) attaches `account`'s session 1, registered under session epoch 5.
fn attach(core: &mut Core, ms: u64, account: &str) {
    proxy_attaches(core, ms, account, None);
    let key = registration_asked(core);
    registered(core, ms, key, account, 5, None);
}

/// The session key of the registration an attach just asked the store for.
fn registration_asked(core: &mut Core) -> SessionKey {
    store_requests(core)
        .into_iter()
        .find_map(|r| match r {
            StoreRequest::Register { session, .. } => Some(session),
            _ => None,
        })
        .expect("the attach registers the session")
}

/// The store answers the registration `key` of `account`: session epoch `epoch`, and the
/// directory's master record as it stands.
fn registered(
    core: &mut Core,
    ms: u64,
    key: SessionKey,
    account: &str,
    epoch: u64,
    master: Option<MasterEntry>,
) {
    core.handle(
        at(ms),
        Input::Store(StoreReply::Registered {
            session: key,
            account: account.into(),
            result: Ok(Registration {
                epoch,
                record: None,
                master,
            }),
        }),
    );
}

/// Alice attached (at 10 ms), her avatar spawned by the game at (40, 50) in tick 1 (at 20 ms).
fn alice_playing_at_40_50(core: &mut Core) {
    alice_of_a_proxy_of("test", core);
}

/// The records of attached players are saved every `player_record_every_ms` (not only on
/// logout), with where their avatars stand then.
#[test]
fn attached_players_records_are_saved_periodically_with_their_last_position() {
    let mut core = node();
    alice_playing_at_40_50(&mut core);
    game_tick(
        &mut core,
        30_000,
        2,
        game_message::Body::Update(local::Update {
            entity_id: AVATAR,
            position: pos(60.0, 70.0),
            ..Default::default()
        }),
    );
    let records = |reqs: Vec<StoreRequest>| -> Vec<PlayerRecord> {
        reqs.into_iter()
            .flat_map(|r| match r {
                StoreRequest::SaveRecords { records } => records,
                _ => vec![],
            })
            .collect()
    };
    core.handle(at(59_000), Input::Timer);
    assert!(
        records(store_requests(&mut core)).is_empty(),
        "not before a minute"
    );
    core.handle(at(60_000), Input::Timer);
    let saved = records(store_requests(&mut core));
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert_eq!(saved[0].account, "alice");
    assert_eq!(saved[0].last_position, Some([60.0, 70.0, 0.0]));
    // And a minute after that, not before.
    core.handle(at(90_000), Input::Timer);
    assert!(records(store_requests(&mut core)).is_empty());
    core.handle(at(120_000), Input::Timer);
    assert_eq!(records(store_requests(&mut core)).len(), 1);
}

/// The players published for the geo-aware director, every `Players` output of `core`.
fn published_players(core: &mut Core) -> Vec<Vec<cellmesh_stores::topology::PlayerSample>> {
    std::iter::from_fn(|| core.poll_output())
        .filter_map(|o| match o {
            Output::Players(p) => Some(p),
            _ => None,
        })
        .collect()
}

/// In a world of several geos, the gateway publishes its players with the load report: where
/// each avatar is, how fast it went since the last sample, and the RTTs by geo (its own proxy's
/// under the proxy's geo, and what other geos' proxies measured). A world of one geo publishes
/// none.
#[test]
fn attached_players_are_published_with_their_rtts_by_geo_in_a_world_of_geos() {
    let mut core = paris_node();
    alice_of_a_proxy_of("paris", &mut core);
    // A figure no RTT can be is dropped, not published.
    proxy_reports_rtt(
        &mut core,
        (221.0, 219.0),
        &[("hongkong", 6.5, 6.0), ("montreal", f32::NAN, 1.0)],
    );
    let first = published_players(&mut core);
    game_tick(
        &mut core,
        2_020,
        2,
        game_message::Body::Update(local::Update {
            entity_id: AVATAR,
            position: pos(70.0, 90.0),
            ..Default::default()
        }),
    );
    let later = published_players(&mut core);
    let last = later.last().expect("a report within a second or two");
    assert_eq!(last.len(), 1, "{later:?} after {first:?}");
    let alice = &last[0];
    assert_eq!((alice.account.as_str(), alice.session_id), ("alice", 5));
    assert_eq!((alice.pos.x, alice.pos.y), (70.0, 90.0));
    assert_eq!(rtts_of(alice), [("hongkong", 6.5), ("paris", 221.0)]);
    // 50 m since the sample before, a second or two ago.
    assert!(
        alice.speed_mps > 10.0 && alice.speed_mps <= 50.0,
        "{}",
        alice.speed_mps
    );

    // One geo: nothing for a director that places none.
    let mut alone = node();
    attach(&mut alone, 10, "alice");
    for (ms, tick) in [(20, 1), (2_000, 2)] {
        alone.handle(
            at(ms),
            Input::GameFrame {
                conn: 1,
                messages: vec![game_message::Body::TickEnd(local::TickEnd { tick }).into()],
            },
        );
    }
    let outs: Vec<Output> = std::iter::from_fn(|| alone.poll_output()).collect();
    assert!(outs.iter().any(|o| matches!(o, Output::LoadReport(_))));
    assert!(!outs.iter().any(|o| matches!(o, Output::Players(_))));
}

/// A node of paris in a world of paris and hongkong.
fn paris_node() -> Core {
    configured_node(None, |c| {
        c.geo = "paris".into();
        c.geos = vec!["paris".into(), "hongkong".into()];
    })
}

/// Alice attached through a proxy of `geo`, her avatar spawned at (40, 50).
fn alice_of_a_proxy_of(geo: &str, core: &mut Core) {
    proxy_of_geo_attaches(core, 10, "alice", None, geo);
    let key = registration_asked(core);
    registered(core, 10, key, "alice", 5, None);
    game_tick(
        core,
        20,
        1,
        game_message::Body::Spawn(local::Spawn {
            entity_id: AVATAR,
            position: pos(40.0, 50.0),
            owner_account: "alice".into(),
            is_master: true,
            ..Default::default()
        }),
    );
}

/// A proxy whose own geo has no gateway up attaches its players to this node of another geo:
/// what it measured is toward its geo, not this node's, or the director would take a player
/// 6 ms from Hong Kong for one 6 ms from Paris.
#[test]
fn a_fallen_back_proxy_s_figure_is_published_under_its_own_geo() {
    let mut core = paris_node();
    alice_of_a_proxy_of("hongkong", &mut core);
    proxy_reports_rtt(&mut core, (6.5, 6.0), &[("paris", 221.0, 219.0)]);
    game_tick(
        &mut core,
        2_020,
        2,
        game_message::Body::Update(local::Update {
            entity_id: AVATAR,
            position: pos(45.0, 50.0),
            ..Default::default()
        }),
    );
    let published = published_players(&mut core);
    let alice = &published.last().expect("a report")[0];
    assert_eq!(rtts_of(alice), [("hongkong", 6.5), ("paris", 221.0)]);
}

/// The proxy of link 20 reports session 1's RTT: its own (p50, min), and the other geos' as
/// (geo, p50, min).
fn proxy_reports_rtt(core: &mut Core, (p50, min): (f32, f32), far: &[(&str, f32, f32)]) {
    let far = far
        .iter()
        .map(|&(geo, rtt_ms_p50, rtt_ms_min)| mesh::GeoRtt {
            geo: geo.into(),
            rtt_ms_p50,
            rtt_ms_min,
        })
        .collect();
    core.handle(
        at(30),
        Input::LinkFrame {
            link: 20,
            messages: vec![mesh_message::Body::Rtt(mesh::SessionRtt {
                session_id: 1,
                rtt_ms_p50: p50,
                rtt_ms_min: min,
                far,
            })
            .into()],
        },
    );
}

/// A published player's RTTs, by geo.
fn rtts_of(p: &cellmesh_stores::topology::PlayerSample) -> Vec<(&str, f32)> {
    p.rtt_ms.iter().map(|(g, ms)| (g.as_str(), *ms)).collect()
}

use cellmesh_proto::edge::KickReason;

/// A session handed over to another geo keeps its avatar for the login there, as long as the
/// handover's hint lives, where a client that just left loses it at once.
#[test]
fn a_handed_over_players_avatar_waits_for_the_login_in_the_other_geo() {
    let leaves = |core: &mut Core| {
        to_game(core)
            .into_iter()
            .filter(|b| matches!(b, sidecar_message::Body::PlayerLeave(_)))
            .count()
    };
    let detach = |core: &mut Core, ms: u64, reason: KickReason| {
        core.handle(
            at(ms),
            Input::LinkFrame {
                link: 20,
                messages: vec![mesh_message::Body::Detach(mesh::Detach {
                    session_id: 1,
                    kick_reason: reason as u32,
                    detail: "handed over to geo paris".into(),
                    retry_after_ms: 0,
                })
                .into()],
            },
        );
    };
    for (reason, waits) in [
        (KickReason::Transferred, true),
        (KickReason::KickUnspecified, false),
    ] {
        let mut core = node();
        attach(&mut core, 10, "alice");
        game_tick(
            &mut core,
            20,
            1,
            game_message::Body::Spawn(local::Spawn {
                entity_id: AVATAR,
                position: pos(40.0, 50.0),
                owner_account: "alice".into(),
                is_master: true,
                ..Default::default()
            }),
        );
        to_game(&mut core);
        detach(&mut core, 1_000, reason);
        let (mut saved, mut left) = (Vec::<PlayerRecord>::new(), 0);
        while let Some(out) = core.poll_output() {
            match out {
                Output::Store(StoreRequest::EndSession { record, .. }) => saved.push(record),
                Output::ToGame { frame, .. } => {
                    left += frame
                        .messages
                        .iter()
                        .filter(|m| matches!(m.body, Some(sidecar_message::Body::PlayerLeave(_))))
                        .count()
                }
                _ => {}
            }
        }
        assert_eq!(saved.len(), 1, "{reason:?}");
        assert_eq!(saved[0].session_epoch, 5);
        assert_eq!(saved[0].last_handover_unix_ms.is_some(), waits);
        if !waits {
            assert_eq!(left, 1, "a client that left: the avatar leaves");
            continue;
        }
        assert_eq!(left, 0);
        for ms in [1_001, 5_000, 30_000, 60_000] {
            core.handle(at(ms), Input::Timer);
            assert_eq!(leaves(&mut core), 0, "still waiting at {ms} ms");
        }
        core.handle(at(61_100), Input::Timer);
        assert_eq!(
            leaves(&mut core),
            1,
            "nobody logged in there: the avatar leaves"
        );
    }
}

/// A login handed over from another geo whose avatar this geo's directory does not name waits
/// for the avatar's owner to anchor it (the owner hears of the newer session), and spawns one
/// only if none does in time; a plain login with no avatar spawns one at once.
#[test]
fn a_handed_over_login_waits_for_its_avatars_owner_before_spawning_one() {
    for handed_over in [false, true] {
        let mut core = node();
        let hint = handed_over.then(|| mesh::HandoverHint {
            session_epoch: 4,
            last_position: None,
            issued_unix_ms: 0,
            source: "hint".into(),
        });
        proxy_attaches(&mut core, 10, "alice", hint);
        let reqs = store_requests(&mut core);
        let (key, from) = reqs
            .iter()
            .find_map(|r| match r {
                StoreRequest::Register {
                    session,
                    handed_over_from,
                    ..
                } => Some((*session, *handed_over_from)),
                _ => None,
            })
            .expect("registered");
        assert_eq!(from, handed_over.then_some(4));
        core.handle(
            at(20),
            Input::Store(StoreReply::Registered {
                session: key,
                account: "alice".into(),
                result: Ok(Registration {
                    epoch: 5,
                    record: None,
                    master: None,
                }),
            }),
        );
        let joins = |core: &mut Core| {
            to_game(core)
                .into_iter()
                .filter(|b| matches!(b, sidecar_message::Body::PlayerJoin(_)))
                .count()
        };
        if !handed_over {
            assert_eq!(
                joins(&mut core),
                1,
                "a new player's avatar is spawned at once"
            );
            continue;
        }
        assert_eq!(joins(&mut core), 0, "the owner elsewhere is waited for");
        core.handle(at(2_900), Input::Timer);
        assert_eq!(joins(&mut core), 0);
        core.handle(at(3_100), Input::Timer);
        assert_eq!(joins(&mut core), 1, "nobody anchored it in time: spawned");
    }
}

/// `alice` logs in (session epoch 5) while the directory names node 2, under lease 1, as her
/// avatar's writer and no link to node 2 is up.
fn alice_registered_while_her_writer_is_cut_off() -> Core {
    let mut core = node();
    gateway_live(&mut core, 0);
    proxy_attaches(&mut core, 10, "alice", None);
    let key = registration_asked(&mut core);
    let master = MasterEntry {
        node: GATEWAY,
        lease_epoch: 1,
        entity_id: AVATAR,
        entity_epoch: 1,
    };
    registered(&mut core, 20, key, "alice", 5, Some(master));
    core
}

/// A login whose avatar the directory says a live node writes, while the link to that node is
/// down (a cut), waits for no restore: the join goes to the writer as soon as the link is back,
/// not after the wait for a restored avatar (which would leave the session without an avatar
/// for seconds if the writer let the old one go in the meantime).
#[test]
fn a_login_whose_avatars_writer_is_unreachable_joins_it_once_the_link_is_back() {
    let mut core = alice_registered_while_her_writer_is_cut_off();
    let joins_sent = |links: &[(LinkId, mesh_message::Body)]| {
        links
            .iter()
            .filter(|(link, b)| {
                *link == PEER_LINK
                    && matches!(b, mesh_message::Body::PlayerJoin(j)
                        if j.account == "alice" && j.session_epoch == 5)
            })
            .count()
    };
    let spawned = |game: &[sidecar_message::Body]| {
        game.iter()
            .filter(|b| matches!(b, sidecar_message::Body::PlayerJoin(_)))
            .count()
    };
    let (game, links) = outputs(&mut core);
    assert_eq!(
        spawned(&game),
        0,
        "a live node writes the avatar: none here"
    );
    assert_eq!(joins_sent(&links), 0, "no link to node 2 yet");
    core.handle(at(500), Input::Timer);
    let (game, _) = outputs(&mut core);
    assert_eq!(spawned(&game), 0, "the writer is waited for");
    link_up(&mut core, 1_000, PEER_LINK, GATEWAY);
    core.handle(at(1_100), Input::Timer);
    let (game, links) = outputs(&mut core);
    assert_eq!(
        joins_sent(&links),
        1,
        "the link is back: the join goes to the writer"
    );
    assert_eq!(spawned(&game), 0, "and no second avatar is spawned here");
    core.handle(at(1_200), Input::Timer);
    let (_, links) = outputs(&mut core);
    assert_eq!(joins_sent(&links), 0, "the join goes once");
}

/// The same login, but the link that comes back is from a process restarted in place under a
/// new lease before membership said so: it restores its predecessor's world, avatar included, so
/// the session goes on waiting for that restore and no join is sent (a join would have its game
/// spawn a second avatar).
#[test]
fn a_writer_restarted_in_place_is_not_sent_the_join_of_its_predecessors_avatar() {
    let mut core = alice_registered_while_her_writer_is_cut_off();
    let joins_sent = |links: &[(LinkId, mesh_message::Body)]| {
        links
            .iter()
            .filter(|(_, b)| matches!(b, mesh_message::Body::PlayerJoin(j) if j.account == "alice"))
            .count()
    };
    outputs(&mut core);
    link_up_as(&mut core, 1_000, PEER_LINK, GATEWAY, 2);
    core.handle(at(1_100), Input::Timer);
    let (_, links) = outputs(&mut core);
    assert_eq!(
        joins_sent(&links),
        0,
        "the process at the link's end is not the avatar's writer"
    );
    core.handle(
        at(1_200),
        Input::PeerLeases {
            live: vec![(GATEWAY, 2)],
            lapsed: vec![],
        },
    );
    core.handle(at(1_300), Input::Timer);
    let (game, links) = outputs(&mut core);
    assert_eq!(joins_sent(&links), 0, "nor once membership names it");
    assert!(
        !game
            .iter()
            .any(|b| matches!(b, sidecar_message::Body::PlayerJoin(_))),
        "and none is spawned here while the restore may anchor the session"
    );
}

/// The two-geo lab's kill-geo: both nodes of a geo died at once, and a player's session moved to
/// this gateway while their worlds were restored. Her avatar's record named one of them, but the
/// avatar had gone to the other a moment before (the record lags a handoff): the end of the
/// first restore is no reason to give up on it while the second is under way. The wait is cut
/// short once every restore is over.
#[test]
fn a_session_waits_for_its_avatar_while_any_restore_is_under_way() {
    let mut core = node();
    gateway_live(&mut core, 0);
    link_up(&mut core, 5, PEER_LINK, GATEWAY);
    for dead in [3, 4] {
        from_peer(
            &mut core,
            10,
            mesh_message::Body::RestoreQuery(mesh::RestoreQuery {
                node: dead,
                lease_epoch: 1,
            }),
        );
    }
    proxy_attaches(&mut core, 20, "alice", None);
    let key = registration_asked(&mut core);
    let master = MasterEntry {
        node: 3,
        lease_epoch: 1,
        entity_id: AVATAR,
        entity_epoch: 1,
    };
    registered(&mut core, 30, key, "alice", 5, Some(master));
    let spawned = |core: &mut Core, ms: u64| {
        core.handle(at(ms), Input::Timer);
        to_game(core)
            .iter()
            .any(|b| matches!(b, sidecar_message::Body::PlayerJoin(j) if j.account == "alice"))
    };
    assert!(!spawned(&mut core, 40), "her avatar is being restored");
    let done = |core: &mut Core, ms: u64, node: NodeId| {
        from_peer(
            core,
            ms,
            mesh_message::Body::RestoreDone(mesh::RestoreDone {
                node,
                lease_epoch: 1,
            }),
        )
    };
    done(&mut core, 1_000, 3);
    assert!(
        !spawned(&mut core, 3_500),
        "node 4's restore may still bring her avatar"
    );
    done(&mut core, 4_000, 4);
    assert!(!spawned(&mut core, 5_900), "a moment for the anchor");
    assert!(
        spawned(&mut core, 6_100),
        "every restore is over and none brought it: a new one"
    );
}

/// The client `alice` on proxy link 20, her avatar at (240, 50) near node 2's border (x 256), and
/// the link to node 2 (link 30) up: her view takes in node 2's chunks.
fn alice_at_the_border(core: &mut Core) {
    link_up(core, 0, 30, GATEWAY);
    attach(core, 10, "alice");
    game_tick(
        core,
        20,
        1,
        game_message::Body::Spawn(local::Spawn {
            entity_id: AVATAR,
            position: pos(240.0, 50.0),
            owner_account: "alice".into(),
            is_master: true,
            ..Default::default()
        }),
    );
    while core.poll_output().is_some() {}
}

/// Node 2 sends the state of its entity 99 at `x`.
fn from_node_2(core: &mut Core, ms: u64, full: bool, x: f64) {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link: 30,
            messages: vec![mesh_message::Body::EntityState(mesh::EntityState {
                entity_id: 99,
                entity_epoch: 1,
                full,
                position: Some(mesh::MeshVec3 { x, y: 50.0, z: 0.0 }),
                components: vec![mesh::PublicComponent {
                    r#type: 1,
                    payload: vec![1, 2, 3].into(),
                }],
                ..Default::default()
            })
            .into()],
        },
    );
}

/// The deltas of entity 99 queued for alice's proxy link, by kind.
fn deltas_of_99(core: &mut Core) -> Vec<i32> {
    batches_of_99(core)
        .into_iter()
        .flatten()
        .map(|(kind, _)| kind)
        .collect()
}

/// A neighbour's update reaches the clients that see it when it arrives, not at this node's
/// next tick (up to a whole tick later), and the tick does not send it again.
#[test]
fn a_ghosts_change_reaches_clients_on_arrival_and_only_once() {
    use cellmesh_proto::edge::DeltaKind;
    let mut core = node();
    alice_at_the_border(&mut core);
    from_node_2(&mut core, 30, true, 270.0);
    assert_eq!(deltas_of_99(&mut core), [DeltaKind::Appear as i32]);
    from_node_2(&mut core, 35, false, 275.0);
    assert_eq!(deltas_of_99(&mut core), [DeltaKind::Update as i32]);

    // The tick sends alice nothing more of it; its other work still sees the ghost's changes.
    game_tick(
        &mut core,
        50,
        2,
        game_message::Body::Update(local::Update {
            entity_id: AVATAR,
            position: pos(241.0, 50.0),
            ..Default::default()
        }),
    );
    assert_eq!(deltas_of_99(&mut core), Vec::<i32>::new());
    from_node_2(&mut core, 60, false, 280.0);
    assert_eq!(deltas_of_99(&mut core), [DeltaKind::Update as i32]);
}

/// cuts: a client saw a ghost vanish from well inside its view two node leases into a cut of
/// the link to the ghost's owner, while that owner was alive and still wrote it. A writer the
/// store still names live keeps its ghosts stale for as long as the cut lasts; only one no
/// longer named live gives them up after two leases.
#[test]
fn a_ghost_of_a_live_owner_cut_off_stays_in_view_past_two_leases() {
    use cellmesh_proto::edge::DeltaKind;
    for (owner_live, vanishes) in [(true, false), (false, true)] {
        let mut core = node();
        alice_at_the_border(&mut core);
        if owner_live {
            gateway_live(&mut core, 25);
        }
        from_node_2(&mut core, 30, true, 270.0);
        assert_eq!(deltas_of_99(&mut core), [DeltaKind::Appear as i32]);
        core.handle(
            at(100),
            Input::LinkClosed {
                link: 30,
                reason: "cut".into(),
            },
        );
        let lease_ms = SidecarConfig::default().node_lease_ms;
        let mut kinds = Vec::new();
        // The game ticks on: a dropped ghost's vanish goes out with the tick's fold.
        for (tick, ms) in (500..=3 * lease_ms).step_by(500).enumerate() {
            core.handle(at(ms), Input::Timer);
            game_frame(&mut core, ms, tick as u64 + 2, None);
            kinds.extend(deltas_of_99(&mut core));
        }
        assert_eq!(
            kinds.contains(&(DeltaKind::Vanish as i32)),
            vanishes,
            "owner live by membership: {owner_live}; deltas {kinds:?}"
        );
    }
}

/// commands seed 288 with zero-tick handoffs: node 2 died, came back in place under lease 2 and
/// restored its predecessor's world, the client's avatar included, while a cut kept it from this
/// gateway. The restore's end dropped the ghost as one nobody took over, and the client saw its
/// own avatar vanish. A ghost of a dead process whose successor is cut off from this node stays,
/// stale, like the ghost of any live writer cut off; with the successor linked, it goes.
#[test]
fn a_restored_ghost_stays_while_the_successor_in_place_is_cut_off() {
    for successor_linked in [false, true] {
        let mut core = node();
        gateway_live(&mut core, 0);
        alice_at_the_border(&mut core);
        from_node_2(&mut core, 30, true, 270.0);
        assert!(core.table.get(99).is_some());
        // Node 2 restarted under lease 2.
        node_2_dies_and_node_4_restores_it(&mut core);
        core.handle(
            at(200),
            Input::PeerLeases {
                live: vec![(GATEWAY, 2), (4, 1)],
                lapsed: vec![],
            },
        );
        if successor_linked {
            link_up_as(&mut core, 250, 31, GATEWAY, 2);
        }
        from_decider(
            &mut core,
            300,
            mesh_message::Body::RestoreDone(mesh::RestoreDone {
                node: GATEWAY,
                lease_epoch: 1,
            }),
        );
        assert_eq!(
            core.table.get(99).is_some(),
            !successor_linked,
            "successor linked: {successor_linked}"
        );
    }
}

/// commands seed 343 with zero-tick handoffs: node 2 handed its entity to node 3 (an offload,
/// which moves an entity to a node that does not own its place) while a cut kept node 2's word
/// (`EntityMoved`) from this gateway, and then died. The restore found node 3 writing it and said
/// so (`RestoreResolved`), but the restore's end dropped this node's ghost, still naming node 2,
/// as one nobody took over: the client saw an entity vanish that node 3 simulates in its view.
/// The ghost follows the writer the restore names.
#[test]
fn a_ghost_of_a_dead_process_follows_the_writer_the_restore_found() {
    let mut core = node();
    gateway_live(&mut core, 0);
    alice_at_the_border(&mut core);
    from_node_2(&mut core, 30, true, 270.0);
    link_up(&mut core, 40, 50, 3);
    node_2_dies_and_node_4_restores_it(&mut core);
    while core.poll_output().is_some() {}
    from_decider(
        &mut core,
        250,
        mesh_message::Body::RestoreResolved(mesh::RestoreResolved {
            entity_id: 99,
            entity_epoch: 3,
            owner_node: 3,
        }),
    );
    let (_, links) = outputs(&mut core);
    assert!(
        links
            .iter()
            .any(|(l, m)| *l == 50 && matches!(m, mesh_message::Body::Subscribe(_))),
        "the gateway subscribes at node 3 where the ghost stands: {links:?}"
    );
    from_decider(
        &mut core,
        300,
        mesh_message::Body::RestoreDone(mesh::RestoreDone {
            node: GATEWAY,
            lease_epoch: 1,
        }),
    );
    let ghost = core.table.get(99).expect("the ghost stays");
    assert_eq!((ghost.origin(), ghost.epoch), (Some(3), 3));
}

/// Node 2's link (30) closes at 100 ms; node 4 links up (link 40) and, at 160 ms, starts
/// deciding the restore of node 2's process under lease 1.
fn node_2_dies_and_node_4_restores_it(core: &mut Core) {
    core.handle(
        at(100),
        Input::LinkClosed {
            link: 30,
            reason: "cut".into(),
        },
    );
    link_up(core, 150, 40, 4);
    from_decider(
        core,
        160,
        mesh_message::Body::RestoreQuery(mesh::RestoreQuery {
            node: GATEWAY,
            lease_epoch: 1,
        }),
    );
}

/// Node 4, the restore's decider, sends `body` at `ms`.
fn from_decider(core: &mut Core, ms: u64, body: mesh_message::Body) {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link: 40,
            messages: vec![body.into()],
        },
    );
}

/// Everything queued: for the game, and for the links as (link, message), in order.
fn outputs(
    core: &mut Core,
) -> (
    Vec<sidecar_message::Body>,
    Vec<(LinkId, mesh_message::Body)>,
) {
    let (mut game, mut links) = (Vec::new(), Vec::new());
    while let Some(out) = core.poll_output() {
        match out {
            Output::ToGame { frame, .. } => {
                game.extend(frame.messages.into_iter().filter_map(|m| m.body))
            }
            Output::ToLink { link, frame } => links.extend(
                frame
                    .messages
                    .into_iter()
                    .filter_map(|m| m.body.map(|b| (link, b))),
            ),
            _ => {}
        }
    }
    (game, links)
}

/// The link to node 2.
const PEER_LINK: LinkId = 10;
const NPC: u64 = 30;

/// The game ends tick `tick` at `ms` with nothing else in the frame, or with `body` first.
fn game_frame(core: &mut Core, ms: u64, tick: u64, body: Option<game_message::Body>) {
    let tick_end = game_message::Body::TickEnd(local::TickEnd { tick });
    core.handle(
        at(ms),
        Input::GameFrame {
            conn: 1,
            messages: body.into_iter().chain([tick_end]).map(Into::into).collect(),
        },
    );
}

/// The game walks `id` four chunks into node 2's area in the tick ending at 100 ms (beyond the
/// reach node 2 watches, so no ghost is waited for), which freezes it.
fn walk_into_node_2(core: &mut Core, id: u64) {
    walk_to(core, id, 12.0 * 32.0 + 10.0);
}

/// The game walks `id` to `x` (at y 40 m) in the tick ending at 100 ms.
fn walk_to(core: &mut Core, id: u64, x: f64) {
    game_tick(
        core,
        100,
        2,
        game_message::Body::Update(local::Update {
            entity_id: id,
            position: pos(x, 40.0),
            ..Default::default()
        }),
    );
}

/// Node 1 hands an NPC to node 2. The game spawns it in the tick ending at 50 ms and walks it
/// four chunks into node 2's area (beyond the reach node 2 watches, so no ghost is waited for)
/// in the tick ending at 100 ms, which freezes it. The game answers the Freeze in the frame of
/// its next tick, or `late_ticks` ticks of 50 ms after that. Returns the epoch offered and when
/// the offer left.
fn freeze_and_answer(core: &mut Core, late_ticks: u64) -> (u64, u64) {
    link_up(core, 10, PEER_LINK, GATEWAY);
    spawn(core, 50, 1, NPC, pos(100.0, 40.0));
    walk_into_node_2(core, NPC);
    let (game, _) = outputs(core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == NPC)),
        "{game:?}"
    );
    let mut ms = 100;
    for tick in 3..3 + late_ticks {
        ms += 50;
        game_frame(core, ms, tick, None);
    }
    ms += 50;
    let snapshot = game_message::Body::Snapshot(local::Snapshot {
        entity_id: NPC,
        entity_epoch: 1,
        state: bytes::Bytes::from_static(b"npc"),
    });
    game_frame(core, ms, 3 + late_ticks, Some(snapshot));
    (offered_to_node_2(core, NPC), ms)
}

/// The epoch `id` was offered to node 2 under, from the outputs queued now.
fn offered_to_node_2(core: &mut Core, id: u64) -> u64 {
    let (_, links) = outputs(core);
    links
        .iter()
        .find_map(|(l, m)| match m {
            mesh_message::Body::HandoffOffer(o) if *l == PEER_LINK && o.entity_id == id => {
                Some(o.entity_epoch)
            }
            _ => None,
        })
        .expect("the offer went to node 2")
}

fn ack(core: &mut Core, ms: u64, epoch: u64, adopt_timing: Option<mesh::AdoptTiming>) {
    ack_of(core, ms, NPC, epoch, adopt_timing);
}

/// Node 2 acks the handoff of `id`: the game is told to evict it. Returns what went to the links.
fn ack_of(
    core: &mut Core,
    ms: u64,
    id: u64,
    epoch: u64,
    adopt_timing: Option<mesh::AdoptTiming>,
) -> Vec<(LinkId, mesh_message::Body)> {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link: PEER_LINK,
            messages: vec![mesh_message::Body::HandoffAck(mesh::HandoffAck {
                entity_id: id,
                entity_epoch: epoch,
                adopt_timing,
            })
            .into()],
        },
    );
    let (game, links) = outputs(core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Evict(e) if e.entity_id == id)),
        "{game:?}"
    );
    links
}

/// (count, max) of one of the metrics' histograms.
fn recorded(h: &std::sync::Mutex<hdrhistogram::Histogram<u64>>) -> (u64, u64) {
    let h = h.lock().unwrap();
    (h.len(), h.max())
}

/// At the ack, the source works out what the handoff cost: the unit's last tick at the source
/// ended at the last TickEnd before the snapshot's frame; the ack says the target's game took
/// 39 ms, and it came 62 ms after the offer left, so the sidecars and the link took 23 ms and
/// the target's first tick ended ~11 ms before the ack. 50 + 39 + 11.5 ms between the two
/// ticks' ends at 20 Hz is two tick periods: one tick missed.
#[test]
fn an_acked_handoff_counts_the_ticks_missed_and_the_sidecars_share_of_the_freeze() {
    for late_ticks in [0, 1] {
        let mut core = node();
        let (epoch, answered) = freeze_and_answer(&mut core, late_ticks);
        ack(
            &mut core,
            answered + 62,
            epoch,
            Some(mesh::AdoptTiming { game_ms: 39 }),
        );
        let m = core.metrics();
        // A game that answers a tick late simulated the unit in that tick: the freeze is a tick
        // longer, the ticks missed and the sidecars' share the same.
        assert_eq!(recorded(&m.freeze_ms), (1, 112 + 50 * late_ticks));
        assert_eq!(recorded(&m.ticks_missed), (1, 1), "late by {late_ticks}");
        assert_eq!(recorded(&m.freeze_sidecars_ms), (1, 23));
    }
}

#[test]
fn an_ack_that_does_not_say_how_long_the_target_s_game_took_counts_only_the_freeze() {
    let mut core = node();
    let (epoch, answered) = freeze_and_answer(&mut core, 0);
    ack(&mut core, answered + 30, epoch, None);
    let m = core.metrics();
    assert_eq!(recorded(&m.freeze_ms), (1, 80));
    assert_eq!(recorded(&m.ticks_missed).0, 0);
    assert_eq!(recorded(&m.freeze_sidecars_ms).0, 0);
}

/// The target's ack says how long its game took to adopt: from the Adopt to the frame carrying
/// `Adopted` (whose tick is the unit's first there), here one tick later than it could have.
#[test]
fn a_target_acks_with_the_time_its_game_took_to_adopt() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    let offer = mesh::HandoffOffer {
        entity_id: NPC,
        entity_epoch: 2,
        partition_epoch: 1,
        position: Some(mesh::MeshVec3 {
            x: 100.0,
            y: 40.0,
            z: 0.0,
        }),
        state: bytes::Bytes::from_static(b"npc"),
        unseen: true,
        ..Default::default()
    };
    let offered = |core: &mut Core, ms: u64| {
        core.handle(
            at(ms),
            Input::LinkFrame {
                link: PEER_LINK,
                messages: vec![mesh_message::Body::HandoffOffer(offer.clone()).into()],
            },
        );
    };
    let acks = |core: &mut Core| -> Vec<mesh::HandoffAck> {
        outputs(core)
            .1
            .into_iter()
            .filter_map(|(l, m)| match m {
                mesh_message::Body::HandoffAck(a) if l == PEER_LINK => Some(a),
                _ => None,
            })
            .collect()
    };
    offered(&mut core, 1_000);
    let (game, _) = outputs(&mut core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Adopt(a) if a.entity_id == NPC)),
        "{game:?}"
    );
    game_frame(&mut core, 1_010, 5, None);
    assert!(acks(&mut core).is_empty());
    let adopted = game_message::Body::Adopted(local::Adopted {
        entity_id: NPC,
        entity_epoch: 2,
    });
    game_frame(&mut core, 1_060, 6, Some(adopted));
    let timed = |game_ms: Option<u64>| mesh::HandoffAck {
        entity_id: NPC,
        entity_epoch: 2,
        adopt_timing: game_ms.map(|game_ms| mesh::AdoptTiming { game_ms }),
    };
    assert_eq!(acks(&mut core), vec![timed(Some(60))]);
    // The same offer again (the source did not hear the ack): acked again, with no time, as
    // the source's freeze holds the lost ack's wait too.
    offered(&mut core, 1_100);
    assert_eq!(acks(&mut core), vec![timed(None)]);
}

/// The cache of which nodes own what is near a chunk stays bounded however many chunks views
/// roam over, and answers the same after it is emptied.
#[test]
fn the_owners_near_cache_stays_bounded() {
    use cellmesh_world::geometry::ChunkPos;
    let mut core = node();
    let first = core.owners_near(ChunkPos { x: 7, y: 3 });
    for i in 0..(replication::NEAR_CACHE_MAX as i64 + 100) {
        core.owners_near(ChunkPos { x: i, y: i / 16 });
        assert!(core.replication.near_cache_len() <= replication::NEAR_CACHE_MAX);
    }
    assert_eq!(core.owners_near(ChunkPos { x: 7, y: 3 }), first);
}

/// The game releases `NPC` (spawned at 50 ms) in the frame of tick 2 at `ms`, after moving it
/// to `x`; `extra` goes between the release and the TickEnd.
fn release_at(core: &mut Core, ms: u64, x: f64, extra: Option<game_message::Body>) {
    link_up(core, 10, PEER_LINK, GATEWAY);
    spawn(core, 50, 1, NPC, pos(100.0, 40.0));
    let _ = outputs(core);
    let after: Vec<_> = extra
        .into_iter()
        .chain([game_message::Body::TickEnd(local::TickEnd { tick: 2 })])
        .collect();
    walk_out_and_release(core, ms, x, npc_release(), &after);
}

/// The NPC's `Release` under epoch 1.
fn npc_release() -> local::Release {
    local::Release {
        entity_id: NPC,
        entity_epoch: 1,
        state: bytes::Bytes::from_static(b"npc"),
        ..Default::default()
    }
}

/// In one game frame at `ms`: `release`'s entity moves to (x, 40) and is released, then `after`.
fn walk_out_and_release(
    core: &mut Core,
    ms: u64,
    x: f64,
    release: local::Release,
    after: &[game_message::Body],
) {
    let walked = game_message::Body::Update(local::Update {
        entity_id: release.entity_id,
        position: pos(x, 40.0),
        ..Default::default()
    });
    let messages = [walked, game_message::Body::Release(release)]
        .into_iter()
        .chain(after.iter().cloned());
    core.handle(
        at(ms),
        Input::GameFrame {
            conn: 1,
            messages: messages.map(Into::into).collect(),
        },
    );
}

fn offer_to_node_2(links: &[(LinkId, mesh_message::Body)]) -> Option<&mesh::HandoffOffer> {
    links.iter().find_map(|(l, m)| match m {
        mesh_message::Body::HandoffOffer(o) if *l == PEER_LINK && o.entity_id == NPC => Some(o),
        _ => None,
    })
}

#[test]
fn the_welcome_gives_the_common_tick_phase_and_the_handoff_margin() {
    let mut core = node();
    let game = to_game(&mut core);
    let Some(sidecar_message::Body::Welcome(w)) = game.first() else {
        panic!("no Welcome first: {game:?}");
    };
    assert_eq!(
        w.tick_phase,
        Some(local::TickPhase {
            origin_unix_ms: 0,
            tick_rate_hz: 20
        })
    );
    assert_eq!(w.handoff_margin_chunks, 1);
    assert_eq!(
        w.version.as_ref().map(|v| v.minor),
        Some(cellmesh_proto::PROTOCOL_MINOR)
    );
}

/// A game that releases an entity it moved out of its area hands it over in that very frame:
/// no Freeze, the offer leaves at once with the game's own snapshot, and with the target's
/// game adopting it in its next tick the unit misses no tick.
#[test]
fn a_released_entity_is_offered_in_the_frame_that_released_it() {
    let mut core = node();
    release_at(&mut core, 100, 12.0 * 32.0 + 10.0, None);
    let (game, links) = outputs(&mut core);
    assert!(
        !game
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(_))),
        "{game:?}"
    );
    let offer = offer_to_node_2(&links).expect("the offer went to node 2 in the same frame");
    assert_eq!(offer.state.as_ref(), b"npc");
    assert_eq!(offer.entity_epoch, 2);
    let epoch = offer.entity_epoch;
    // The target's game adopted it 44 ms later, in its next tick; the ack came 6 ms after that.
    ack(
        &mut core,
        150,
        epoch,
        Some(mesh::AdoptTiming { game_ms: 44 }),
    );
    let m = core.metrics();
    assert_eq!(recorded(&m.freeze_ms), (1, 50));
    assert_eq!(recorded(&m.ticks_missed), (1, 0));
    assert_eq!(recorded(&m.freeze_sidecars_ms), (1, 6));
    let released = crate::metrics::HandoffLabel {
        from: "1".into(),
        to: "2".into(),
        outcome: "released",
    };
    assert_eq!(m.handoffs.get_or_create(&released).get(), 1);
}

/// An entity released a chunk past the line (within the margin) stays: the game gets a Thaw
/// that says why, and writes it as before.
#[test]
fn a_release_within_the_margin_is_thawed_and_the_entity_written_again() {
    let mut core = node();
    release_at(&mut core, 100, 8.0 * 32.0 + 5.0, None);
    let (game, links) = outputs(&mut core);
    assert!(offer_to_node_2(&links).is_none(), "{links:?}");
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::Thaw(t) if t.entity_id == NPC && t.reason.contains("margin"))),
        "{game:?}"
    );
    assert_eq!(core.metrics().releases_kept.get(), 1);
    game_tick(
        &mut core,
        150,
        3,
        game_message::Body::Update(local::Update {
            entity_id: NPC,
            position: pos(8.0 * 32.0 + 6.0, 40.0),
            ..Default::default()
        }),
    );
    let game = to_game(&mut core);
    assert!(
        !game
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::Error(_))),
        "{game:?}"
    );
}

/// A released entity is frozen from the Release on: a write after it in the same tick is
/// refused by name, and the offer carries the released state.
#[test]
fn a_write_after_a_release_is_refused() {
    let mut core = node();
    let write = game_message::Body::Update(local::Update {
        entity_id: NPC,
        position: pos(100.0, 40.0),
        ..Default::default()
    });
    release_at(&mut core, 100, 12.0 * 32.0 + 10.0, Some(write));
    let (game, links) = outputs(&mut core);
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::Error(e) if e.code == local::ErrorCode::NotOwner as i32
                && e.entity_id == NPC && e.detail.contains("released"))),
        "{game:?}"
    );
    let offer = offer_to_node_2(&links).expect("offered all the same");
    let at = offer.position.as_ref().expect("a position");
    assert_eq!(
        at.x,
        12.0 * 32.0 + 10.0,
        "the write after the release was not applied"
    );
}

/// A release of the wrong epoch is refused by name and thawed: the entity stays the game's to
/// write (and the sidecar's own Freeze hands it over).
#[test]
fn a_release_under_a_stale_epoch_is_refused() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn(&mut core, 50, 1, NPC, pos(100.0, 40.0));
    let _ = outputs(&mut core);
    game_tick(
        &mut core,
        100,
        2,
        game_message::Body::Release(local::Release {
            entity_id: NPC,
            entity_epoch: 9,
            state: bytes::Bytes::from_static(b"npc"),
            ..Default::default()
        }),
    );
    let (game, links) = outputs(&mut core);
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::Error(e) if e.code == local::ErrorCode::InvalidValue as i32
                && e.detail.contains("epoch 9"))),
        "{game:?}"
    );
    assert!(offer_to_node_2(&links).is_none());
    assert!(game
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::Thaw(t) if t.entity_id == NPC)));
}

/// The game released an entity the sidecar had just frozen (the two crossed): the release
/// answers the Freeze, and the offer leaves.
#[test]
fn a_release_that_crosses_a_freeze_answers_it() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn(&mut core, 50, 1, NPC, pos(100.0, 40.0));
    game_tick(
        &mut core,
        100,
        2,
        game_message::Body::Update(local::Update {
            entity_id: NPC,
            position: pos(12.0 * 32.0 + 10.0, 40.0),
            ..Default::default()
        }),
    );
    let (game, _) = outputs(&mut core);
    assert!(game
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == NPC)));
    game_tick(
        &mut core,
        150,
        3,
        game_message::Body::Release(local::Release {
            entity_id: NPC,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"released"),
            ..Default::default()
        }),
    );
    let (game, links) = outputs(&mut core);
    let offer = offer_to_node_2(&links).expect("the release answered the freeze");
    assert_eq!(offer.state.as_ref(), b"released");
    assert!(
        !game.iter().any(|m| matches!(
            m,
            sidecar_message::Body::Error(_) | sidecar_message::Body::Thaw(_)
        )),
        "{game:?}"
    );
}

/// The game spawns alice's avatar at (100, 40) in tick 1, at 50 ms; what that queued is dropped.
fn spawn_alices_avatar(core: &mut Core) {
    game_tick(
        core,
        50,
        1,
        game_message::Body::Spawn(local::Spawn {
            entity_id: AVATAR,
            position: pos(100.0, 40.0),
            owner_account: "alice".into(),
            is_master: true,
            ..Default::default()
        }),
    );
    let _ = outputs(core);
}

/// A game of protocol 1.7 does not say which inputs it applied: its release of a player's avatar
/// is thawed with the reason, and the sidecar's Freeze hands the avatar over (holding back the
/// inputs on their way to the game).
#[test]
fn an_older_games_release_of_an_avatar_is_kept_and_the_freeze_hands_it_over() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn_alices_avatar(&mut core);
    walk_out_and_release(
        &mut core,
        100,
        12.0 * 32.0 + 10.0,
        local::Release {
            entity_id: AVATAR,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"alice"),
            ..Default::default()
        },
        &[game_message::Body::TickEnd(local::TickEnd { tick: 2 })],
    );
    let (game, links) = outputs(&mut core);
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::Thaw(t) if t.entity_id == AVATAR && t.reason.contains("1.8"))),
        "{game:?}"
    );
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == AVATAR)),
        "the Freeze hands it over: {game:?}"
    );
    assert!(!links
        .iter()
        .any(|(_, m)| matches!(m, mesh_message::Body::HandoffOffer(_))));
}

/// Client input `seq` of alice's session (proxy link 20) at `ms`.
fn alices_input(core: &mut Core, ms: u64, seq: u64) {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link: 20,
            messages: vec![mesh_message::Body::Input(mesh::SessionInput {
                session_id: 1,
                seq,
                payload: bytes::Bytes::from(seq.to_string()),
            })
            .into()],
        },
    );
}

/// The sequence numbers of alice's inputs handed to the game.
fn alices_inputs(game: &[sidecar_message::Body]) -> Vec<u64> {
    game.iter()
        .filter_map(|m| match m {
            sidecar_message::Body::Input(i) if i.account == "alice" => Some(i.seq),
            _ => None,
        })
        .collect()
}

/// Alice (session epoch 5) plays on this node next to node 2; her inputs 1 to 4 reach the
/// game, which applied 1 and 2 when it releases her avatar at `x` in the frame of tick 2 (at
/// 100 ms). Input 5 comes before that tick's end (at 101 ms).
fn release_alice_after_two_of_four_inputs(core: &mut Core, x: f64) {
    link_up(core, 10, PEER_LINK, GATEWAY);
    attach(core, 10, "alice");
    spawn_alices_avatar(core);
    for seq in 1..=4 {
        alices_input(core, 60 + seq, seq);
    }
    let (game, _) = outputs(core);
    assert_eq!(alices_inputs(&game), [1, 2, 3, 4]);
    walk_out_and_release(
        core,
        100,
        x,
        local::Release {
            entity_id: AVATAR,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"alice"),
            last_input_seq: 2,
            input_session_epoch: 5,
            ..Default::default()
        },
        &[],
    );
    alices_input(core, 100, 5);
    game_frame(core, 101, 2, None);
}

/// A game of protocol 1.8 releases a player's avatar like an NPC, naming the last input it
/// applied: the offer leaves in that frame, and the inputs the game got after that one (which
/// it drops) go right behind it, in order, before the ones that come later. The target resumes
/// the player's inputs after the one the game applied.
#[test]
fn a_released_avatar_takes_the_inputs_its_game_did_not_apply_with_it() {
    let mut core = releasing_node();
    release_alice_after_two_of_four_inputs(&mut core, 12.0 * 32.0 + 10.0);
    alices_input(&mut core, 120, 6);
    let (game, links) = outputs(&mut core);
    assert!(
        !game.iter().any(|m| matches!(
            m,
            sidecar_message::Body::Freeze(_) | sidecar_message::Body::Thaw(_)
        )),
        "{game:?}"
    );
    assert!(alices_inputs(&game).is_empty(), "{game:?}");
    let offer = links
        .iter()
        .position(|(l, m)| {
            *l == PEER_LINK
                && matches!(m, mesh_message::Body::HandoffOffer(o)
                    if o.entity_id == AVATAR && o.last_input_seq == 2 && o.session_epoch == 5)
        })
        .expect("offered in the frame, resuming after input 2");
    let forwarded: Vec<(usize, u64)> = links
        .iter()
        .enumerate()
        .filter_map(|(k, (l, m))| match m {
            mesh_message::Body::ForwardInput(f) if *l == PEER_LINK && f.account == "alice" => {
                Some((k, f.seq))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        forwarded.iter().map(|f| f.1).collect::<Vec<_>>(),
        [3, 4, 5, 6]
    );
    assert!(forwarded.iter().all(|(k, _)| *k > offer), "{links:?}");
    let epoch = offer_epoch(&links, AVATAR);
    // The target's game adopted it 40 ms later, in its next tick: no tick missed.
    let timing = Some(mesh::AdoptTiming { game_ms: 40 });
    ack_of(&mut core, 150, AVATAR, epoch, timing);
    let m = core.metrics();
    assert_eq!(recorded(&m.ticks_missed), (1, 0));
    assert_eq!(m.inputs_dropped_for("input_released_unkept"), 0);
}

/// The epoch `id` was offered under, in `links`.
fn offer_epoch(links: &[(LinkId, mesh_message::Body)], id: u64) -> u64 {
    links
        .iter()
        .find_map(|(_, m)| match m {
            mesh_message::Body::HandoffOffer(o) if o.entity_id == id => Some(o.entity_epoch),
            _ => None,
        })
        .expect("an offer")
}

/// A released avatar that stays (within the margin) is thawed, and the game gets the inputs it
/// did not apply again, after the Thaw and in order; the next input follows them.
#[test]
fn a_kept_avatar_gets_the_inputs_it_did_not_apply_again() {
    let mut core = releasing_node();
    release_alice_after_two_of_four_inputs(&mut core, 8.0 * 32.0 + 5.0);
    alices_input(&mut core, 120, 6);
    let (game, links) = outputs(&mut core);
    assert!(!links
        .iter()
        .any(|(_, m)| matches!(m, mesh_message::Body::HandoffOffer(_))));
    let thaw = game
        .iter()
        .position(|m| matches!(m, sidecar_message::Body::Thaw(t) if t.entity_id == AVATAR))
        .expect("thawed");
    let first_input = game
        .iter()
        .position(|m| matches!(m, sidecar_message::Body::Input(_)))
        .expect("inputs again");
    assert!(thaw < first_input, "{game:?}");
    assert_eq!(alices_inputs(&game), [3, 4, 5, 6]);
}

/// A game of protocol 1.8 that does not answer an `Offload` within three ticks has the entity
/// frozen instead. Its release of an avatar that crossed that Freeze answers it, and the inputs
/// its game got after the last one it applied go behind the offer ahead of the ones held since.
#[test]
fn an_avatar_release_crossing_a_freeze_hands_on_what_its_game_did_not_apply() {
    let mut core = releasing_node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    attach(&mut core, 10, "alice");
    spawn_alices_avatar(&mut core);
    for seq in 1..=3 {
        alices_input(&mut core, 60 + seq, seq);
    }
    walk_into_node_2(&mut core, AVATAR);
    let (game, _) = outputs(&mut core);
    assert!(game
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::Offload(o) if o.entity_id == AVATAR)));
    // The game does not release it within three ticks: the sidecar freezes it instead.
    for (tick, ms) in [(3, 150), (4, 200), (5, 250)] {
        game_frame(&mut core, ms, tick, None);
    }
    let (game, _) = outputs(&mut core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == AVATAR)),
        "{game:?}"
    );
    // Held by the Freeze, not handed to the game.
    alices_input(&mut core, 260, 4);
    game_tick(
        &mut core,
        300,
        6,
        game_message::Body::Release(local::Release {
            entity_id: AVATAR,
            entity_epoch: 1,
            state: bytes::Bytes::from_static(b"alice"),
            last_input_seq: 1,
            input_session_epoch: 5,
            ..Default::default()
        }),
    );
    let (game, links) = outputs(&mut core);
    assert!(alices_inputs(&game).is_empty(), "{game:?}");
    let offer = links
        .iter()
        .find_map(|(_, m)| match m {
            mesh_message::Body::HandoffOffer(o) if o.entity_id == AVATAR => Some(o),
            _ => None,
        })
        .expect("the release answered the freeze");
    assert_eq!(offer.last_input_seq, 1);
    let forwarded: Vec<u64> = links
        .iter()
        .filter_map(|(_, m)| match m {
            mesh_message::Body::ForwardInput(f) if f.account == "alice" => Some(f.seq),
            _ => None,
        })
        .collect();
    assert_eq!(forwarded, [2, 3, 4]);
}

/// A game of protocol 1.8 is not frozen for a handoff the sidecar decides: it is asked to release
/// the entity at its next tick's end (`Offload`), simulates it in that tick, and its `Release`
/// is offered in that frame. Asked once, not at every tick it stays due.
#[test]
fn a_game_that_takes_offload_releases_what_the_sidecar_hands_over() {
    let mut core = releasing_node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn(&mut core, 50, 1, NPC, pos(100.0, 40.0));
    walk_into_node_2(&mut core, NPC);
    let (game, links) = outputs(&mut core);
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::Offload(o) if o.entity_id == NPC && o.entity_epoch == 1)),
        "{game:?}"
    );
    assert!(!game
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::Freeze(_))));
    assert!(offer_to_node_2(&links).is_none());
    // Its next tick moves it on (still due): not asked again.
    walk_out_and_release(
        &mut core,
        150,
        12.0 * 32.0 + 11.0,
        npc_release(),
        &[game_message::Body::TickEnd(local::TickEnd { tick: 3 })],
    );
    let (game, links) = outputs(&mut core);
    assert!(
        !game.iter().any(|m| matches!(
            m,
            sidecar_message::Body::Offload(_)
                | sidecar_message::Body::Freeze(_)
                | sidecar_message::Body::Error(_)
        )),
        "{game:?}"
    );
    let offer = offer_to_node_2(&links).expect("the release is offered in its frame");
    assert_eq!(
        offer.position.as_ref().map(|p| p.x),
        Some(12.0 * 32.0 + 11.0)
    );
    ack(
        &mut core,
        200,
        offer.entity_epoch,
        Some(mesh::AdoptTiming { game_ms: 40 }),
    );
    assert_eq!(recorded(&core.metrics().ticks_missed), (1, 0));
}

/// A proxy link `link` comes up.
fn proxy_up(core: &mut Core, ms: u64, link: LinkId) {
    core.handle(
        at(ms),
        Input::LinkUp {
            link,
            hello: mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: mesh::PeerRole::Proxy as i32,
                id: format!("edge-{link}"),
                geo: "test".into(),
                partition_epoch: 0,
                node_id: 0,
                lease_epoch: 0,
                ..Default::default()
            },
            remote: "edge".into(),
            rest: vec![],
        },
    );
}

/// The game reports its load: `tick_ms` of a 50 ms budget.
fn load(core: &mut Core, ms: u64, tick_ms: f32) {
    core.handle(
        at(ms),
        Input::GameFrame {
            conn: 1,
            messages: vec![game_message::Body::Load(local::Load {
                tick_ms,
                budget_ms: 50.0,
                entity_count: 1,
            })
            .into()],
        },
    );
}

/// The admission messages queued, as (link, open, reason, retry hint).
fn admissions(core: &mut Core) -> Vec<(LinkId, bool, String, u32)> {
    outputs(core)
        .1
        .into_iter()
        .filter_map(|(link, b)| match b {
            mesh_message::Body::Admission(a) => Some((link, a.open, a.reason, a.retry_after_ms)),
            _ => None,
        })
        .collect()
}

fn closings(core: &Core, reason: &'static str) -> u64 {
    core.cx
        .metrics
        .admission_closings
        .get_or_create(&crate::metrics::ReasonLabel { reason })
        .get()
}

/// The game's load reports reach the balancer's figure smoothed (the gauge and `/state` say it),
/// and a game gone silent is estimated from the reals it holds.
#[test]
fn load_reports_are_smoothed_and_a_silent_game_is_estimated_from_its_reals() {
    let mut core = node();
    load(&mut core, 1000, 10.0);
    assert_eq!(core.cx.metrics.load.get(), 0.2);
    assert_eq!(core.state()["load"]["source"], "game");
    load(&mut core, 2000, 40.0);
    let smoothed = core.cx.metrics.load.get();
    assert!((smoothed - (0.2 + 0.2 * 0.6)).abs() < 1e-9, "{smoothed}");
    assert_eq!(core.state()["load"]["smoothed"], smoothed);
    // Silent past `silent_after_ms`: the next tick estimates it from the reals (none here).
    core.handle(
        at(6000),
        Input::GameFrame {
            conn: 1,
            messages: vec![game_message::Body::TickEnd(local::TickEnd { tick: 1 }).into()],
        },
    );
    assert_eq!(core.state()["load"]["source"], "estimate");
    assert!(core.cx.metrics.load.get() < smoothed, "falls toward 0");
}

/// A game that overruns its tick closes the node to new sessions: every proxy link hears it
/// (one that comes up later too), and a calm held for `reopen_after_ms` opens it again.
#[test]
fn a_tick_overrun_closes_admission_on_every_proxy_link_and_a_calm_reopens_it() {
    let mut core = node();
    link_up(&mut core, 0, PEER_LINK, GATEWAY);
    proxy_up(&mut core, 0, 20);
    assert_eq!(admissions(&mut core), [], "open needs no word");
    assert_eq!(core.cx.metrics.admission_open.get(), 1);

    load(&mut core, 1000, 30.0);
    assert_eq!(admissions(&mut core), []);
    load(&mut core, 2000, 47.0);
    let closed = (false, "tick_overrun".to_string(), 5000);
    assert_eq!(
        admissions(&mut core),
        [(20, closed.0, closed.1.clone(), closed.2)],
        "the proxy link hears it, the peer link does not"
    );
    assert_eq!(core.cx.metrics.admission_open.get(), 0);
    assert_eq!(closings(&core, "tick_overrun"), 1);
    assert_eq!(core.state()["admission"]["open"], false);
    assert_eq!(core.state()["admission"]["reason"], "tick_overrun");

    // A proxy that connects while the node is closed hears it at once.
    proxy_up(&mut core, 2500, 21);
    assert_eq!(
        admissions(&mut core),
        [(21, closed.0, closed.1.clone(), closed.2)]
    );

    // Calm from 3 s on; reopened 5 s after the last hot report, not before.
    let mut opened = Vec::new();
    for t in (2100u64..=8000).step_by(100) {
        if t.is_multiple_of(1000) {
            load(&mut core, t, 20.0);
        } else {
            core.handle(at(t), Input::Timer);
        }
        opened.extend(admissions(&mut core).into_iter().map(|a| (t, a)));
    }
    assert_eq!(
        opened,
        [
            (7000, (20, true, String::new(), 0)),
            (7000, (21, true, String::new(), 0))
        ]
    );
    assert_eq!(core.cx.metrics.admission_open.get(), 1);
    assert_eq!(core.state()["admission"]["open"], true);
    assert_eq!(closings(&core, "tick_overrun"), 1, "closed once");
}

/// A proxy link whose outbox backs up closes the node with its own reason; a backed-up peer
/// link does not (this node's client batches do not wait there).
#[test]
fn a_backed_up_proxy_link_closes_admission_and_a_peer_link_does_not() {
    let mut core = node();
    link_up(&mut core, 0, PEER_LINK, GATEWAY);
    proxy_up(&mut core, 0, 20);
    core.handle(
        at(100),
        Input::LinkBacklog {
            link: PEER_LINK,
            frames: 5000,
        },
    );
    assert_eq!(admissions(&mut core), []);
    core.handle(
        at(200),
        Input::LinkBacklog {
            link: 20,
            frames: 128,
        },
    );
    assert_eq!(
        admissions(&mut core),
        [(20, false, "outbox_pressure".to_string(), 5000)]
    );
    assert_eq!(closings(&core, "outbox_pressure"), 1);
    core.handle(at(5100), Input::Timer);
    assert_eq!(admissions(&mut core), [], "not 5 s calm yet");
    core.handle(at(5200), Input::Timer);
    assert_eq!(admissions(&mut core), [(20, true, String::new(), 0)]);
}

/// The batches queued for alice's proxy link, each as the (kind, x) of entity 99's deltas.
fn batches_of_99(core: &mut Core) -> Vec<Vec<(i32, f64)>> {
    use prost::Message;
    let mut batches = Vec::new();
    while let Some(out) = core.poll_output() {
        let Output::ToLink { link: 20, frame } = out else {
            continue;
        };
        for m in frame.messages {
            let Some(mesh_message::Body::ToClient(c)) = m.body else {
                continue;
            };
            let sf = cellmesh_proto::edge::ServerFrame::decode(c.server_frame).unwrap();
            for m in sf.messages {
                if let Some(cellmesh_proto::edge::server_message::Body::Batch(b)) = m.body {
                    batches.push(
                        b.deltas
                            .iter()
                            .filter(|d| d.entity_id == 99)
                            .map(|d| (d.kind, d.position.as_ref().map_or(f64::NAN, |p| p.x)))
                            .collect(),
                    );
                }
            }
        }
    }
    batches
}

/// A backlog of peer frames handled in one go (as the driver does, up to a burst, before it
/// asks for output) costs each client one batch with the newest state, not one per frame.
#[test]
fn a_backlog_of_peer_frames_reaches_a_client_as_one_batch_with_the_newest_state() {
    use cellmesh_proto::edge::DeltaKind;
    let mut core = node();
    alice_at_the_border(&mut core);
    from_node_2(&mut core, 30, true, 270.0);
    assert_eq!(
        batches_of_99(&mut core),
        [vec![(DeltaKind::Appear as i32, 270.0)]]
    );
    for (i, x) in [271.0, 272.0, 273.0, 274.0, 275.0].into_iter().enumerate() {
        from_node_2(&mut core, 40 + i as u64, false, x);
    }
    assert_eq!(
        batches_of_99(&mut core),
        [vec![(DeltaKind::Update as i32, 275.0)]],
        "five frames, one batch, the last position"
    );
    // One frame at a time, one batch each, as before.
    from_node_2(&mut core, 50, false, 276.0);
    assert_eq!(
        batches_of_99(&mut core),
        [vec![(DeltaKind::Update as i32, 276.0)]]
    );
}

/// A proxy link's attach of `account` as session `session_id`, moved from another gateway or new.
fn attach_on(core: &mut Core, ms: u64, link: LinkId, session_id: u64, account: &str, moved: bool) {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link,
            messages: vec![mesh_message::Body::Attach(mesh::Attach {
                session_id,
                account: account.into(),
                remote_addr: String::new(),
                moved,
                moved_from_epoch: 0,
                handover: None,
                attestation: attested(account, session_id, ms),
            })
            .into()],
        },
    );
}

/// What the node did with the attaches just made: (session, registered?) and the refusals as
/// (session, kick reason, retry hint, detail).
#[allow(clippy::type_complexity)]
fn attach_answers(core: &mut Core) -> (usize, Vec<(u64, u32, u32, String)>) {
    let mut registered = 0;
    let mut refused = Vec::new();
    while let Some(out) = core.poll_output() {
        match out {
            Output::Store(StoreRequest::Register { .. }) => registered += 1,
            Output::ToLink { frame, .. } => {
                for m in frame.messages {
                    if let Some(mesh_message::Body::Detach(d)) = m.body {
                        refused.push((d.session_id, d.kick_reason, d.retry_after_ms, d.detail));
                    }
                }
            }
            _ => {}
        }
    }
    (registered, refused)
}

/// Between two load reports the node admits only so many new sessions; the next is refused
/// `SERVER_FULL` with a short hint (its proxy had not heard yet), and a session that moves here
/// from a broken gateway is never refused. An overrun refuses with the long hint.
#[test]
fn a_login_burst_is_paced_and_a_closed_node_refuses_new_sessions_but_not_moved_ones() {
    use cellmesh_proto::edge::KickReason;
    let mut core = node();
    proxy_up(&mut core, 0, 20);
    load(&mut core, 1000, 10.0);
    while core.poll_output().is_some() {}
    for i in 1..=20 {
        attach_on(&mut core, 1100, 20, i, &format!("p{i}"), false);
    }
    let (registered, refused) = attach_answers(&mut core);
    assert_eq!((registered, refused.len()), (20, 0), "{refused:?}");
    assert_eq!(
        core.admission.closed().map(|(r, _)| r.as_str()),
        Some("login_burst"),
        "the allowance (at least 20 a report) is used up"
    );

    attach_on(&mut core, 1200, 20, 21, "p21", false);
    attach_on(&mut core, 1200, 20, 22, "p22", true);
    let (registered, refused) = attach_answers(&mut core);
    assert_eq!(registered, 1, "the moved session is attached");
    assert_eq!(refused.len(), 1, "{refused:?}");
    let (session, reason, hint, detail) = &refused[0];
    assert_eq!(
        (*session, *reason, *hint),
        (21, KickReason::ServerFull as u32, 1000)
    );
    assert!(
        detail.contains("node 1") && detail.contains("login_burst"),
        "{detail}"
    );

    // The next report is calm: new sessions are taken again.
    load(&mut core, 2000, 10.0);
    assert_eq!(admissions(&mut core), [(20, true, String::new(), 0)]);
    attach_on(&mut core, 2100, 20, 23, "p23", false);
    assert_eq!(attach_answers(&mut core), (1, vec![]));

    // An overrun: refused with the overload hint.
    load(&mut core, 3000, 49.0);
    while core.poll_output().is_some() {}
    attach_on(&mut core, 3100, 20, 24, "p24", false);
    let (registered, refused) = attach_answers(&mut core);
    assert_eq!(registered, 0);
    assert_eq!(refused[0].2, 5000);
    assert!(refused[0].3.contains("tick_overrun"), "{:?}", refused[0]);
}

#[test]
fn a_node_whose_cell_is_retired_stays_a_spare_or_drains_as_configured() {
    for (when, drains) in [
        (crate::config::WhenRetired::Spare, false),
        (crate::config::WhenRetired::Exit, true),
    ] {
        let mut core = configured_node(None, |c| c.when_retired = when);
        let world = *core.authority.partition().shape();
        // Epoch 2 squeezes node 1 to no area (still a cell); epoch 3 deletes the cell.
        let squeezed = cellmesh_world::partition::BspTree::split(
            cellmesh_world::partition::Axis::X,
            0,
            cellmesh_world::partition::BspTree::leaf(ME),
            cellmesh_world::partition::BspTree::leaf(GATEWAY),
        );
        let bsp = cellmesh_world::partition::Bsp::new(&world, &squeezed).unwrap();
        let p2 = Partition::new(world, 2, Layout::Bsp(bsp)).unwrap();
        core.handle(at(10), Input::Partition(Box::new(p2.clone())));
        assert!(
            !core.authority.draining(),
            "a cell with no area is not retired yet"
        );
        let p3 = p2
            .successor(Layout::Bsp(
                cellmesh_world::partition::Bsp::even(&world, &[GATEWAY]).unwrap(),
            ))
            .unwrap();
        core.handle(at(20), Input::Partition(Box::new(p3)));
        assert_eq!(core.authority.draining(), drains, "{when:?}");
    }
}

/// A session moving here from a lost gateway carries the epoch it held there, and registers
/// only above it; when the directory says a newer login came since, it ends displaced, with no
/// `Attached` and no avatar, and the node forgets it.
#[test]
fn a_moved_session_superseded_by_a_newer_login_is_displaced() {
    use cellmesh_proto::edge::KickReason;
    let mut core = node();
    proxy_up(&mut core, 0, 20);
    while core.poll_output().is_some() {}
    let attach = |core: &mut Core, session_id: u64, moved: bool, moved_from_epoch: u64| {
        core.handle(
            at(100),
            Input::LinkFrame {
                link: 20,
                messages: vec![mesh_message::Body::Attach(mesh::Attach {
                    session_id,
                    account: "ada".into(),
                    remote_addr: String::new(),
                    moved,
                    moved_from_epoch,
                    handover: None,
                    attestation: attested("ada", session_id, 100),
                })
                .into()],
            },
        );
        let mut registers = Vec::new();
        while let Some(out) = core.poll_output() {
            if let Output::Store(StoreRequest::Register {
                session,
                moved_from,
                ..
            }) = out
            {
                registers.push((session, moved_from));
            }
        }
        assert_eq!(registers.len(), 1, "{registers:?}");
        registers[0]
    };
    // A new login, and a move that had not been attached yet, register as any login.
    assert_eq!(attach(&mut core, 1, false, 0).1, None);
    assert_eq!(attach(&mut core, 2, true, 0).1, None);
    let (key, moved_from) = attach(&mut core, 3, true, 41);
    assert_eq!(moved_from, Some(41));

    core.handle(
        at(110),
        Input::Store(StoreReply::Superseded {
            session: key,
            account: "ada".into(),
        }),
    );
    let mut detached = Vec::new();
    while let Some(out) = core.poll_output() {
        match out {
            Output::ToLink { link, frame } => {
                for m in frame.messages {
                    match m.body {
                        Some(mesh_message::Body::Detach(d)) => {
                            detached.push((link, d.session_id, d.kick_reason))
                        }
                        Some(mesh_message::Body::Attached(a)) => {
                            panic!("a superseded session was attached: {a:?}")
                        }
                        _ => {}
                    }
                }
            }
            Output::Store(StoreRequest::Register { .. }) => panic!("registered again"),
            _ => {}
        }
    }
    assert_eq!(detached, [(20, 3, KickReason::Displaced as u32)]);
    assert!(core.gateway.session(key).is_none(), "forgotten");
    // Told twice (a late duplicate), nothing more happens.
    core.handle(
        at(120),
        Input::Store(StoreReply::Superseded {
            session: key,
            account: "ada".into(),
        }),
    );
    assert!(std::iter::from_fn(|| core.poll_output()).all(|o| !matches!(o, Output::ToLink { .. })));
}

/// Node 1 in geo eu, which knows node 2 (of `geo`) with its lease 1 live.
fn node_in_eu_with_peer_in(geo: &str) -> Core {
    let mut core = configured_node(None, |c| c.geo = "eu".into());
    core.handle(
        at(0),
        Input::Peers(vec![PeerInfo {
            node: GATEWAY,
            mesh_addr: "node-2".into(),
            geo: geo.into(),
        }]),
    );
    gateway_live(&mut core, 0);
    core
}

/// The decider of node 2's geo fences node 2's lease once it stayed lapsed past the grace; a
/// node of another geo with no live node of its own is fenced by nobody (a geo cut off from the
/// topology store finds its leases unfenced when the cut heals).
#[test]
fn a_lapsed_peer_is_fenced_by_its_own_geos_decider_only() {
    for (peer_geo, fenced) in [("eu", true), ("us", false)] {
        let mut core = node_in_eu_with_peer_in(peer_geo);
        core.handle(
            at(100),
            Input::PeerLeases {
                live: vec![],
                lapsed: vec![(GATEWAY, 1)],
            },
        );
        let mut fences = Vec::new();
        for ms in (200..=10_000).step_by(100) {
            core.handle(at(ms), Input::Timer);
            for r in store_requests(&mut core) {
                if let StoreRequest::FenceLease { node, epoch } = r {
                    fences.push((ms, node, epoch));
                }
            }
        }
        let grace = super::restore::lapse_grace_ms(SidecarConfig::default().node_lease_ms);
        if fenced {
            let (ms, node, epoch) = fences.first().copied().expect("a fence");
            assert_eq!((node, epoch), (GATEWAY, 1));
            assert!(ms >= 100 + grace, "fenced at {ms} ms, before the grace");
        } else {
            assert!(fences.is_empty(), "{fences:?}");
        }
    }
}

/// The lab's partition-geo: an owner cut off from a bridged player's gateway in another geo asked
/// its own geo's directory where the session was, found nothing (the session is in the gateway's
/// geo's directory) and released the avatar of a player still playing. A miss counts only for a
/// gateway whose sessions that directory holds (same geo), or one that died.
#[test]
fn an_owner_cut_off_from_a_gateway_of_another_geo_keeps_its_players_avatar() {
    const SESSION: u64 = 5;
    for (gateway_geo, gateway_lives, released) in
        [("us", true, false), ("us", false, true), ("eu", true, true)]
    {
        let case = format!("gateway in {gateway_geo}, lease live: {gateway_lives}");
        let mut core = node_in_eu_with_peer_in(gateway_geo);
        link_up(&mut core, 10, PEER_LINK, GATEWAY);
        from_peer(
            &mut core,
            20,
            mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                account: "alice".into(),
                session_epoch: SESSION,
                ..Default::default()
            }),
        );
        spawn_alices_avatar(&mut core);
        core.handle(
            at(100),
            Input::LinkClosed {
                link: PEER_LINK,
                reason: "cut".into(),
            },
        );
        if !gateway_lives {
            // Its lease is gone: its process is dead, and its sessions moved or ended.
            core.handle(
                at(150),
                Input::PeerLeases {
                    live: vec![],
                    lapsed: vec![],
                },
            );
        }
        let mut leaves = Vec::new();
        for ms in (200..=6_000).step_by(100) {
            core.handle(at(ms), Input::Timer);
            while let Some(out) = core.poll_output() {
                match out {
                    Output::Store(StoreRequest::Lookup { account }) => core.handle(
                        at(ms),
                        Input::Store(StoreReply::LookedUp {
                            account,
                            result: Ok(None),
                        }),
                    ),
                    Output::ToGame { frame, .. } => {
                        leaves.extend(frame.messages.into_iter().filter_map(|m| match m.body {
                            Some(sidecar_message::Body::PlayerLeave(l)) => Some(l.account),
                            _ => None,
                        }))
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(!leaves.is_empty(), released, "{case}: leaves {leaves:?}");
    }
}

/// The topology store says the gateway's lease (epoch 1) is live, at `ms`.
fn gateway_live(core: &mut Core, ms: u64) {
    core.handle(
        at(ms),
        Input::PeerLeases {
            live: vec![(GATEWAY, 1)],
            lapsed: vec![],
        },
    );
}

/// Node 1 simulates alice's avatar for her gateway, node 2: the join, and the game's spawn at
/// 50 ms.
fn alice_simulated_here(core: &mut Core) {
    link_up(core, 10, PEER_LINK, GATEWAY);
    from_peer(
        core,
        20,
        mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
            account: "alice".into(),
            session_epoch: 1,
            ..Default::default()
        }),
    );
    spawn_alices_avatar(core);
}

/// Alice walks into node 2's area at 100 ms, and node 1 hands her avatar over (acked at 200 ms).
fn alice_handed_to_node_2(core: &mut Core) {
    walk_into_node_2(core, AVATAR);
    let snapshot = game_message::Body::Snapshot(local::Snapshot {
        entity_id: AVATAR,
        entity_epoch: 1,
        state: bytes::Bytes::from_static(b"alice"),
    });
    game_frame(core, 150, 3, Some(snapshot));
    let epoch = offered_to_node_2(core, AVATAR);
    ack_of(core, 200, AVATAR, epoch, None);
}

fn from_peer(core: &mut Core, ms: u64, body: mesh_message::Body) {
    core.handle(
        at(ms),
        Input::LinkFrame {
            link: PEER_LINK,
            messages: vec![body.into()],
        },
    );
}

/// The two-geo lab's kill-proxy, and geos seeds 101 and 198 with a proxy restart: the leave of
/// the session the dead proxy ended waited here for a newer join, then followed the avatar
/// handed on meanwhile, and overtook the newer session's join, which went another way: the new
/// owner let the avatar go, and the player came back to none. A node that knows of a newer
/// session keeps the old leave to itself.
#[test]
fn an_old_sessions_leave_does_not_follow_a_handed_on_avatar_past_a_newer_session() {
    for newer_known in [false, true] {
        let mut core = node();
        alice_simulated_here(&mut core);
        // The proxy died: the gateway ended session 1; its leave waits here for a newer join.
        from_peer(
            &mut core,
            60,
            mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
                account: "alice".into(),
                session_epoch: 1,
                reason: format!("{}: connection reset", super::avatars::PROXY_LINK_LOST),
            }),
        );
        alice_handed_to_node_2(&mut core);
        if newer_known {
            from_peer(
                &mut core,
                1_500,
                mesh_message::Body::SessionMoved(mesh::SessionMoved {
                    account: "alice".into(),
                    session_epoch: 2,
                    gateway_node: GATEWAY,
                    new_avatar: false,
                }),
            );
        }
        let mut leaves = 0;
        for ms in [2_000, 4_000, 6_000] {
            core.handle(at(ms), Input::Timer);
            let (_, links) = outputs(&mut core);
            leaves += links
                .iter()
                .filter(|(l, m)| {
                    *l == PEER_LINK
                        && matches!(m, mesh_message::Body::PlayerLeave(p) if p.account == "alice")
                })
                .count();
        }
        assert_eq!(
            leaves,
            usize::from(!newer_known),
            "newer session known: {newer_known}"
        );
    }
}

/// geos seed 38: a gateway found no avatar for a handed-over login in time (a cut kept the owner
/// from it) and gave the session a new one, here; when the link came back, the older avatar's
/// owner joined the session and anchored it, and the account had two. Of two avatars the older
/// goes: the gateway keeps its own and tells the other's node to let it go.
#[test]
fn an_older_avatar_that_anchors_a_session_given_a_new_one_is_told_to_leave() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    attach(&mut core, 20, "alice");
    let (game, links) = outputs(&mut core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(j) if j.account == "alice")),
        "{game:?}"
    );
    assert!(
        links.iter().any(|(l, m)| *l == PEER_LINK
            && matches!(m, mesh_message::Body::SessionMoved(s) if s.account == "alice" && s.new_avatar)),
        "{links:?}"
    );
    spawn_alices_avatar(&mut core);
    // The older avatar, node 2's, anchors the session.
    from_peer(
        &mut core,
        100,
        mesh_message::Body::Anchor(mesh::Anchor {
            account: "alice".into(),
            session_epoch: 5,
            entity_id: 99,
            entity_epoch: 3,
            position: Some(mesh::MeshVec3 {
                x: 300.0,
                y: 40.0,
                z: 0.0,
            }),
        }),
    );
    let (_, links) = outputs(&mut core);
    let told: Vec<_> = links
        .iter()
        .filter_map(|(l, m)| match m {
            mesh_message::Body::PlayerLeave(p) if *l == PEER_LINK => Some(p),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 1, "{links:?}");
    assert_eq!(
        (told[0].account.as_str(), told[0].session_epoch),
        ("alice", 5)
    );
    assert_eq!(told[0].reason, "new_avatar_elsewhere");
    assert_eq!(core.gateway.master_owner("alice"), Some(ME));
}

/// An offer of alice's avatar at (100, 40) under `epoch`, serving her session 5 on node 3.
fn alices_avatar_of_session_5(epoch: u64) -> mesh::HandoffOffer {
    mesh::HandoffOffer {
        entity_id: AVATAR,
        entity_epoch: epoch,
        partition_epoch: 1,
        position: Some(mesh::MeshVec3 {
            x: 100.0,
            y: 40.0,
            z: 0.0,
        }),
        state: bytes::Bytes::from_static(b"alice"),
        is_master: true,
        owner_account: "alice".into(),
        session_epoch: 5,
        gateway_node: 3,
        ..Default::default()
    }
}

/// The two-geo lab's kill-geo: a player's session moved to a core gateway, which waited for the
/// restore of her avatar in vain and gave her a new one; the restore then brought the old avatar
/// here, which joined the newer session and anchored it beside the new one. An avatar adopted
/// after its account's newer session was given a new one leaves at once and anchors nothing.
#[test]
fn an_avatar_adopted_after_its_session_got_a_new_one_leaves_and_anchors_nothing() {
    for new_avatar in [false, true] {
        let mut core = node();
        link_up(&mut core, 10, PEER_LINK, GATEWAY);
        from_peer(
            &mut core,
            100,
            mesh_message::Body::SessionMoved(mesh::SessionMoved {
                account: "alice".into(),
                session_epoch: 6,
                gateway_node: GATEWAY,
                new_avatar,
            }),
        );
        from_peer(
            &mut core,
            200,
            mesh_message::Body::HandoffOffer(mesh::HandoffOffer {
                unseen: true,
                ..alices_avatar_of_session_5(2)
            }),
        );
        let (game, _) = outputs(&mut core);
        assert!(
            game.iter()
                .any(|m| matches!(m, sidecar_message::Body::Adopt(a) if a.entity_id == AVATAR)),
            "{game:?}"
        );
        game_frame(
            &mut core,
            250,
            2,
            Some(game_message::Body::Adopted(local::Adopted {
                entity_id: AVATAR,
                entity_epoch: 2,
            })),
        );
        let (game, links) = outputs(&mut core);
        let left: Vec<_> = game
            .iter()
            .filter_map(|m| match m {
                sidecar_message::Body::PlayerLeave(l) if l.account == "alice" => Some(l),
                _ => None,
            })
            .collect();
        let joined = game
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(j) if j.account == "alice"));
        let anchored = links
            .iter()
            .any(|(_, m)| matches!(m, mesh_message::Body::Anchor(a) if a.account == "alice"));
        if new_avatar {
            assert_eq!(left.len(), 1, "{game:?}");
            assert_eq!(left[0].session_epoch, 5);
            assert!(!joined && !anchored, "{game:?} {links:?}");
        } else {
            assert!(left.is_empty(), "{game:?}");
            assert!(joined && anchored, "{game:?} {links:?}");
        }
    }
}

/// The restore of a dead process's avatar whose player has a newer one (written here, or given
/// by its newer session's gateway) is refused: of two avatars the older goes, and a game is
/// never handed a second avatar of one player.
#[test]
fn the_restore_of_an_avatar_whose_player_has_a_newer_one_is_refused() {
    for newer in ["none", "written here", "elsewhere"] {
        let mut core = node();
        link_up(&mut core, 10, PEER_LINK, GATEWAY);
        match newer {
            "written here" => {
                let spawn = local::Spawn {
                    entity_id: 8,
                    position: pos(120.0, 40.0),
                    owner_account: "alice".into(),
                    is_master: true,
                    ..Default::default()
                };
                game_tick(&mut core, 50, 1, game_message::Body::Spawn(spawn));
            }
            "elsewhere" => from_peer(
                &mut core,
                50,
                mesh_message::Body::SessionMoved(mesh::SessionMoved {
                    account: "alice".into(),
                    session_epoch: 6,
                    gateway_node: GATEWAY,
                    new_avatar: true,
                }),
            ),
            _ => {}
        }
        let _ = outputs(&mut core);
        from_peer(
            &mut core,
            200,
            mesh_message::Body::HandoffOffer(mesh::HandoffOffer {
                successor: true,
                ..alices_avatar_of_session_5(9)
            }),
        );
        let (game, links) = outputs(&mut core);
        let adopted = game
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::Adopt(a) if a.entity_id == AVATAR));
        let refused: Vec<_> = links
            .iter()
            .filter_map(|(l, m)| match m {
                mesh_message::Body::HandoffRefused(r) if *l == PEER_LINK => Some(r),
                _ => None,
            })
            .collect();
        if newer == "none" {
            assert!(adopted && refused.is_empty(), "{game:?} {links:?}");
        } else {
            assert!(!adopted, "{newer}: {game:?}");
            assert_eq!(refused.len(), 1, "{newer}: {links:?}");
            assert_eq!(refused[0].reason, super::restore::SUPERSEDED);
            assert_eq!(refused[0].entity_epoch, 9);
        }
    }
}

/// geos seed 157 (with the real proxy in the simulator): the leave of session 1, whose proxy
/// died, waited here; the player logged in again and was handed over to another geo, and the
/// leave of that session 2 (a transfer, which waits as long as a handover cookie lives) took the
/// place of the first but kept its three-second deadline: the avatar left before the player
/// reached the other geo. The newest session's leave sets the wait.
#[test]
fn a_handed_over_sessions_leave_waits_its_own_grace_past_an_older_pending_leave() {
    let mut core = node();
    alice_simulated_here(&mut core);
    let leave = |epoch: u64, reason: String| {
        mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
            account: "alice".into(),
            session_epoch: epoch,
            reason,
        })
    };
    let proxy_lost = format!("{}: connection reset", super::avatars::PROXY_LINK_LOST);
    from_peer(&mut core, 60, leave(1, proxy_lost));
    let transferred = format!("{}: to geo eu", super::avatars::TRANSFERRED);
    from_peer(&mut core, 1_000, leave(2, transferred));
    let left_at = |core: &mut Core, ms: u64| {
        core.handle(at(ms), Input::Timer);
        let (game, _) = outputs(core);
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(l) if l.account == "alice"))
    };
    for ms in [3_500, 6_000, 30_000] {
        assert!(!left_at(&mut core, ms), "alice's avatar left at {ms} ms");
    }
    let grace = super::avatars::TRANSFER_GRACE_MS;
    assert!(
        left_at(&mut core, 1_000 + grace + 200),
        "the transfer's grace over, the avatar leaves"
    );
}

/// geos seed 179: node 1 simulated alice's avatar for gateway node 2, whose session 1 ended
/// (its proxy died); the leave waited here for a newer join, which a cut kept away. The player
/// was handed over to this node's geo and her login attached here just before the leave was
/// due: the leave went while the login was still registering, the registration then found the
/// master record naming this node's avatar, gone, and the session got a new one seconds later.
/// A due leave waits for a login registering here.
#[test]
fn a_due_leave_waits_for_a_login_registering_on_the_avatars_node() {
    let mut core = node();
    alice_simulated_here(&mut core);
    from_peer(
        &mut core,
        60,
        mesh_message::Body::SessionEnded(mesh::SessionEnded {
            account: "alice".into(),
            session_epoch: 1,
        }),
    );
    let hint = mesh::HandoverHint {
        session_epoch: 2,
        last_position: None,
        issued_unix_ms: 0,
        source: "hint".into(),
    };
    proxy_attaches(&mut core, 3_000, "alice", Some(hint));
    let key = registration_asked(&mut core);
    let game_of = |core: &mut Core, ms: u64| {
        core.handle(at(ms), Input::Timer);
        outputs(core).0
    };
    let left = |game: &[sidecar_message::Body]| {
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(l) if l.account == "alice"))
    };
    for ms in [3_100, 3_200] {
        let game = game_of(&mut core, ms);
        assert!(!left(&game), "alice's avatar left at {ms} ms: {game:?}");
    }
    let master = MasterEntry {
        node: ME,
        lease_epoch: core.restore.incarnation(),
        entity_id: AVATAR,
        entity_epoch: 1,
    };
    registered(&mut core, 3_250, key, "alice", 3, Some(master));
    let game = game_of(&mut core, 3_300);
    assert!(
        game.iter().any(|m| matches!(m,
            sidecar_message::Body::PlayerJoin(j) if j.account == "alice" && j.session_epoch == 3)),
        "the login joins the avatar here: {game:?}"
    );
    for ms in [3_400, 6_000] {
        let game = game_of(&mut core, ms);
        assert!(!left(&game), "alice's avatar left at {ms} ms: {game:?}");
    }
}

/// geos seed 245: node 1 simulated alice's avatar for gateway node 2, whose proxy died; node 2's
/// leave of session 1 waited here for a newer join. The player logged in again on node 2, whose
/// join was lost in a cut between the two, and the leave went while the link was down: when it
/// came back, node 2 announced session 2 to a node with no avatar left, and the session had none
/// to the end. The grace runs only while the gateway can be heard; a dead one's leave goes.
#[test]
fn a_leave_from_a_cut_off_gateway_waits_for_its_link_to_come_back() {
    for (gateway_lives, newer_session) in [(true, true), (true, false), (false, false)] {
        let case = format!("gateway lives: {gateway_lives}, newer session: {newer_session}");
        let mut core = node();
        gateway_live(&mut core, 0);
        alice_simulated_here(&mut core);
        from_peer(
            &mut core,
            60,
            mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
                account: "alice".into(),
                session_epoch: 1,
                reason: format!("{}: connection reset", super::avatars::PROXY_LINK_LOST),
            }),
        );
        core.handle(
            at(1_000),
            Input::LinkClosed {
                link: PEER_LINK,
                reason: "cut".into(),
            },
        );
        if !gateway_lives {
            core.handle(
                at(1_100),
                Input::PeerLeases {
                    live: vec![],
                    lapsed: vec![],
                },
            );
        }
        let mut left_at = None;
        let mut joined = false;
        for ms in (1_200..=12_000).step_by(100) {
            if ms == 6_000 {
                link_up(&mut core, ms, PEER_LINK, GATEWAY);
            }
            if ms == 6_100 && newer_session {
                from_peer(
                    &mut core,
                    ms,
                    mesh_message::Body::SessionMoved(mesh::SessionMoved {
                        account: "alice".into(),
                        session_epoch: 2,
                        gateway_node: GATEWAY,
                        new_avatar: false,
                    }),
                );
            }
            core.handle(at(ms), Input::Timer);
            for m in outputs(&mut core).0 {
                match m {
                    sidecar_message::Body::PlayerLeave(l) if l.account == "alice" => {
                        left_at.get_or_insert(ms);
                    }
                    sidecar_message::Body::PlayerJoin(j)
                        if j.account == "alice" && j.session_epoch == 2 =>
                    {
                        joined = true
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(joined, newer_session, "{case}");
        match (gateway_lives, newer_session) {
            (true, true) => assert_eq!(left_at, None, "{case}"),
            (true, false) => assert!(
                // The grace from the last step that found the link down.
                left_at.is_some_and(|ms| ms >= 5_900 + super::avatars::LEAVE_GRACE_MS),
                "{case}: left at {left_at:?}"
            ),
            _ => assert!(
                left_at.is_some_and(|ms| ms <= 60 + super::avatars::LEAVE_GRACE_MS + 100),
                "{case}: left at {left_at:?}"
            ),
        }
    }
}

/// stores seed 49 (with the real proxy in the simulator): an avatar was handed on twice during a
/// store outage, so the directory's master record still named an earlier owner when its player
/// logged in again, on the very node now writing it. The gateway believed the record over its
/// own table and sent the join away; it was passed on once and ended on a node the avatar had
/// left, whose game spawned the account a second avatar. A node writing the avatar joins it
/// here, whatever the record says.
#[test]
fn a_login_on_the_node_writing_its_avatar_joins_it_here_past_a_stale_master_record() {
    let mut core = node();
    gateway_live(&mut core, 0);
    alice_simulated_here(&mut core);
    proxy_attaches(&mut core, 100, "alice", None);
    let key = registration_asked(&mut core);
    let master = MasterEntry {
        node: GATEWAY,
        lease_epoch: 1,
        entity_id: AVATAR,
        entity_epoch: 1,
    };
    registered(&mut core, 110, key, "alice", 5, Some(master));
    let (game, links) = outputs(&mut core);
    assert!(
        !links
            .iter()
            .any(|(_, m)| matches!(m, mesh_message::Body::PlayerJoin(j) if j.account == "alice")),
        "the join stays here: {links:?}"
    );
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(j)
            if j.account == "alice" && j.session_epoch == 5)),
        "the game here joins its avatar to the new session: {game:?}"
    );
    assert!(
        links
            .iter()
            .any(|(_, m)| matches!(m, mesh_message::Body::SessionMoved(s)
            if s.account == "alice" && !s.new_avatar)),
        "and no new avatar is announced: {links:?}"
    );
}

/// stores seed 217 (with the real proxy in the simulator): a login found no master record (its
/// writes were waiting out a store outage) and had a new avatar spawned on the node that still
/// simulated the old one, which anchored the session with the old avatar (epoch 2) as its game
/// let it go. The gateway took the new avatar's anchor (epoch 1) for a late word from a previous
/// owner and dropped it: its inputs, stamped with epoch 2, waited at the owner's fence for an
/// epoch the new avatar never reached. Epochs compare within one entity only.
#[test]
fn a_new_avatars_anchor_is_taken_after_an_older_avatars_of_a_higher_epoch() {
    let mut core = alice_registered_while_her_writer_is_cut_off();
    link_up(&mut core, 1_000, PEER_LINK, GATEWAY);
    core.handle(at(1_100), Input::Timer);
    let anchor = |id: u64, epoch: u64, x: f64| {
        mesh_message::Body::Anchor(mesh::Anchor {
            account: "alice".into(),
            session_epoch: 5,
            entity_id: id,
            entity_epoch: epoch,
            position: Some(mesh::MeshVec3 { x, y: 40.0, z: 0.0 }),
        })
    };
    from_peer(&mut core, 1_200, anchor(AVATAR, 2, 300.0));
    // Node 2's game let that avatar go and spawned the new one the gateway asked for.
    from_peer(&mut core, 1_300, anchor(99, 1, 420.0));
    outputs(&mut core);
    core.handle(
        at(1_400),
        Input::LinkFrame {
            link: 20,
            messages: vec![mesh_message::Body::Input(mesh::SessionInput {
                session_id: 1,
                seq: 1,
                payload: bytes::Bytes::from_static(b"w"),
            })
            .into()],
        },
    );
    let (_, links) = outputs(&mut core);
    let stamped: Vec<u64> = links
        .iter()
        .filter_map(|(l, m)| match m {
            mesh_message::Body::ForwardInput(f) if *l == PEER_LINK => Some(f.entity_epoch),
            _ => None,
        })
        .collect();
    assert_eq!(stamped, vec![1], "stamped with the new avatar's epoch");
}

/// spawners seed 234 (with the real proxy in the simulator): a game crashed before its player's
/// new avatar had a checkpoint; back within its grace, it was told to spawn the avatar again,
/// and the player's next input, which came before that spawn, was handed to a game with no
/// avatar to apply it to (it waited for ids to spawn one). Until the game's avatar is back the
/// input is counted as dropped here.
#[test]
fn an_input_before_a_returning_games_new_avatar_is_dropped_not_delivered() {
    let mut core = node();
    attach(&mut core, 10, "alice");
    spawn_alices_avatar(&mut core);
    let input = |core: &mut Core, ms: u64, seq: u64| {
        core.handle(
            at(ms),
            Input::LinkFrame {
                link: 20,
                messages: vec![mesh_message::Body::Input(mesh::SessionInput {
                    session_id: 1,
                    seq,
                    payload: bytes::Bytes::from_static(b"w"),
                })
                .into()],
            },
        );
        to_game(core)
            .iter()
            .filter(|m| matches!(m, sidecar_message::Body::Input(i) if i.account == "alice"))
            .count()
    };
    assert_eq!(input(&mut core, 60, 1), 1);
    core.handle(
        at(100),
        Input::GameClosed {
            conn: 1,
            reason: "crashed".into(),
        },
    );
    hello(&mut core, 500, 2);
    let back = to_game(&mut core);
    assert!(
        back.iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(j) if j.account == "alice")),
        "{back:?}"
    );
    assert!(core.reals().is_empty(), "no checkpoint: the avatar is gone");
    assert_eq!(input(&mut core, 520, 2), 0, "no avatar to apply it to yet");
    assert_eq!(
        core.metrics().inputs_dropped_for("input_avatar_respawning"),
        1
    );
    core.handle(
        at(550),
        Input::GameFrame {
            conn: 2,
            messages: vec![
                game_message::Body::Spawn(local::Spawn {
                    entity_id: AVATAR + 1,
                    position: pos(100.0, 40.0),
                    owner_account: "alice".into(),
                    is_master: true,
                    ..Default::default()
                })
                .into(),
                game_message::Body::TickEnd(local::TickEnd { tick: 1 }).into(),
            ],
        },
    );
    assert_eq!(input(&mut core, 600, 3), 1, "the new avatar takes it");
}

/// stores seed 917 (with avatars released): alice's avatar went from node 2 to this node to a
/// third while a store outage kept the directory at node 2. Her relogin's join went to node 2,
/// which passed it on to this node, which had handed the avatar on too: it delivered the join to
/// its own game, which spawned her a second avatar. A join follows the avatar node by node (at
/// most `MAX_JOIN_HOPS`), and one passed around more than that is dropped, never spawned.
#[test]
fn a_join_passed_on_follows_the_avatar_on_through_a_node_that_handed_it_on_too() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn_alices_avatar(&mut core);
    walk_into_node_2(&mut core, AVATAR);
    let _ = outputs(&mut core);
    let snapshot = game_message::Body::Snapshot(local::Snapshot {
        entity_id: AVATAR,
        entity_epoch: 1,
        state: bytes::Bytes::from_static(b"alice"),
    });
    game_frame(&mut core, 150, 3, Some(snapshot));
    let epoch = offered_to_node_2(&mut core, AVATAR);
    ack_of(&mut core, 200, AVATAR, epoch, None);
    let join = |hops: u32| {
        mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
            account: "alice".into(),
            session_epoch: 6,
            last_position: None,
            gateway_node: 3,
            hops,
        })
    };
    from_peer(&mut core, 300, join(1));
    let (game, links) = outputs(&mut core);
    assert!(
        !game
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(_))),
        "{game:?}"
    );
    let passed: Vec<(u32, u32)> = links
        .iter()
        .filter_map(|(l, m)| match m {
            mesh_message::Body::PlayerJoin(j) if *l == PEER_LINK => Some((j.gateway_node, j.hops)),
            _ => None,
        })
        .collect();
    assert_eq!(passed, [(3, 2)], "passed on to node 2, the gateway kept");
    from_peer(&mut core, 400, join(super::routing::MAX_JOIN_HOPS));
    let (game, links) = outputs(&mut core);
    assert!(!game
        .iter()
        .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(_))));
    assert!(!links
        .iter()
        .any(|(_, m)| matches!(m, mesh_message::Body::PlayerJoin(_))));
    assert_eq!(core.metrics().dropped_for("join_forward_loop"), 1);
}

/// geo_restore seeds 309 and 721: node 2 offered its entity 99 to node 3, which adopted it and
/// wrote it under epoch 2 (the ghost here followed it), then died before checkpointing it. The
/// restore gave the unit back to node 2, still frozen there, which writes it under the epoch it
/// had (1). The restore's end dropped this node's ghost, still naming node 3, as one nobody took
/// over, and node 2's frames under epoch 1 would have been dropped as stale: the client saw the
/// entity vanish for good. The ghost goes back to node 2, and node 2's frames refresh it.
#[test]
fn a_ghost_that_followed_a_dead_target_goes_back_to_the_node_the_unit_returned_to() {
    let mut core = node();
    core.handle(
        at(0),
        Input::PeerLeases {
            live: vec![(GATEWAY, 1), (3, 1)],
            lapsed: vec![],
        },
    );
    alice_at_the_border(&mut core);
    from_node_2(&mut core, 30, true, 270.0);
    link_up(&mut core, 40, 50, 3);
    // The ghost follows node 3 under epoch 2 (node 2's word stands for the overdue rule).
    core.handle(
        at(50),
        Input::LinkFrame {
            link: 30,
            messages: vec![mesh_message::Body::EntityMoved(mesh::EntityMoved {
                entity_id: 99,
                entity_epoch: 2,
                owner_node: 3,
                holders: vec![],
            })
            .into()],
        },
    );
    core.handle(
        at(60),
        Input::LinkFrame {
            link: 50,
            messages: vec![mesh_message::Body::EntityState(mesh::EntityState {
                entity_id: 99,
                entity_epoch: 2,
                full: true,
                position: Some(mesh::MeshVec3 {
                    x: 272.0,
                    y: 50.0,
                    z: 0.0,
                }),
                ..Default::default()
            })
            .into()],
        },
    );
    assert_eq!(
        core.table.get(99).map(|e| (e.origin(), e.epoch)),
        Some((Some(3), 2))
    );
    // Node 3 dies; node 4 decides its restore.
    core.handle(
        at(100),
        Input::LinkClosed {
            link: 50,
            reason: "cut".into(),
        },
    );
    core.handle(
        at(140),
        Input::PeerLeases {
            live: vec![(GATEWAY, 1), (4, 1)],
            lapsed: vec![],
        },
    );
    link_up(&mut core, 150, 40, 4);
    from_decider(
        &mut core,
        160,
        mesh_message::Body::RestoreQuery(mesh::RestoreQuery {
            node: 3,
            lease_epoch: 1,
        }),
    );
    while core.poll_output().is_some() {}
    from_decider(
        &mut core,
        250,
        mesh_message::Body::RestoreResolved(mesh::RestoreResolved {
            entity_id: 99,
            entity_epoch: 0,
            owner_node: GATEWAY,
        }),
    );
    from_decider(
        &mut core,
        300,
        mesh_message::Body::RestoreDone(mesh::RestoreDone {
            node: 3,
            lease_epoch: 1,
        }),
    );
    assert_eq!(
        core.table.get(99).map(|e| e.origin()),
        Some(Some(GATEWAY)),
        "the ghost stays, following node 2"
    );
    // Node 2's frame under the epoch it had is taken, not dropped as stale.
    from_node_2(&mut core, 320, true, 280.0);
    let ghost = core.table.get(99).expect("the ghost stays");
    assert_eq!((ghost.origin(), ghost.epoch), (Some(GATEWAY), 1));
    assert_eq!(ghost.position.x, 280.0);
}

/// stores seed 162 with zero-tick handoffs: node 4 offloaded an NPC to node 3 and kept its
/// ghost (it subscribes to the chunk at node 3), but node 3 never counted node 4 among the
/// ghost's holders: it sent node 4 nothing when the NPC walked on, not even its gone, and the
/// ghost stood still for good. The source that keeps a ghost is listed to the new owner.
#[test]
fn a_source_that_keeps_its_ghost_is_among_the_new_owners_holders() {
    let mut core = node();
    link_up(&mut core, 10, PEER_LINK, GATEWAY);
    spawn(&mut core, 50, 1, NPC, pos(200.0, 40.0));
    // Just across the border, in a chunk node 1 subscribes to at node 2 (its band).
    walk_to(&mut core, NPC, 9.0 * 32.0 + 5.0);
    let chunk = core.table.get(NPC).expect("the NPC").chunk;
    assert!(core.replication.subscribes(chunk, GATEWAY), "{chunk:?}");
    // Node 2 subscribes to the chunk here: it holds the NPC's ghost when it is offered.
    core.handle(
        at(110),
        Input::LinkFrame {
            link: PEER_LINK,
            messages: vec![mesh_message::Body::Subscribe(mesh::Subscribe {
                chunks: vec![mesh::ChunkRef {
                    x: chunk.x,
                    y: chunk.y,
                }],
            })
            .into()],
        },
    );
    game_frame(&mut core, 120, 3, None);
    let (game, _) = outputs(&mut core);
    assert!(
        game.iter()
            .any(|m| matches!(m, sidecar_message::Body::Freeze(f) if f.entity_id == NPC)),
        "{game:?}"
    );
    let snapshot = game_message::Body::Snapshot(local::Snapshot {
        entity_id: NPC,
        entity_epoch: 1,
        state: bytes::Bytes::from_static(b"npc"),
    });
    game_frame(&mut core, 150, 4, Some(snapshot));
    let epoch = offered_to_node_2(&mut core, NPC);
    let links = ack_of(&mut core, 200, NPC, epoch, None);
    let told = links
        .iter()
        .find_map(|(l, m)| match m {
            mesh_message::Body::EntityMoved(m) if *l == PEER_LINK && m.entity_id == NPC => {
                Some(m.holders.clone())
            }
            _ => None,
        })
        .expect("the new owner hears the move");
    assert_eq!(told, vec![1], "node 1 keeps a ghost: {links:?}");
    let ghost = core.table.get(NPC).expect("the ghost stays");
    assert_eq!((ghost.origin(), ghost.epoch), (Some(GATEWAY), epoch));
}
