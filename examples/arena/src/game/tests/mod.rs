//! The arena's tests, by concept; the helpers every concept uses are here.

mod attacks;
mod dens;
mod handoff;
mod trading;

use super::*;
use crate::schema::{SampleSnapshot, SnapshotKind, SNAPSHOT_VERSION};
use cellmesh_proto::local::{
    Adopt, Adopted, Claim, ClaimLost, ClaimOutcome, ClaimResult, Command, CommandError, CommandIn,
    CommandReply, CommandResult, Despawn, Evict, Freeze, GhostEnter, IdsReserved, Input,
    PlayerJoin, PlayerLeave, SpawnerOwned, Thaw, Vec3, WorldShape,
};
use sidecar_message::Body as M;

const NODE: u32 = 3;
const SIZE: f64 = 1000.0;

fn welcome() -> Welcome {
    Welcome {
        node_id: NODE,
        world: Some(WorldShape {
            width: SIZE,
            height: SIZE,
            chunk_size: 32.0,
            region_size: 500.0,
        }),
        ..Default::default()
    }
}

fn arena(npcs: u32, census: &Arc<Census>) -> Arena {
    arena_welcomed(npcs, census, &welcome())
}

/// An arena of `npcs` around the origin, welcomed with `w`, with ids to spawn them.
fn arena_welcomed(npcs: u32, census: &Arc<Census>, w: &Welcome) -> Arena {
    let cfg = ArenaConfig {
        npcs,
        center: (0.0, 0.0),
        spread: 40.0,
        census: Some(census.clone()),
        ..ArenaConfig::default()
    };
    let mut a = Arena::new(cfg, w);
    let mut out = Vec::new();
    a.request_ids(&mut out);
    a.on_message(
        &mut out,
        M::IdsReserved(IdsReserved {
            request_id: 1,
            ids: (1000..1100).collect(),
        }),
    );
    a
}

fn spawned(out: &[Body]) -> Vec<u64> {
    out.iter()
        .filter_map(|b| match b {
            Body::Spawn(s) => Some(s.entity_id),
            _ => None,
        })
        .collect()
}

/// Whether `out` writes `id` in any way.
fn writes(out: &[Body], id: u64) -> bool {
    out.iter().any(|b| match b {
        Body::Update(u) => u.entity_id == id,
        Body::Event(e) => e.entity_id == id,
        Body::Despawn(d) => d.entity_id == id,
        Body::Spawn(s) => s.entity_id == id,
        _ => false,
    })
}

fn snapshot_of(out: &[Body], id: u64) -> SampleSnapshot {
    let state = out
        .iter()
        .find_map(|b| match b {
            Body::Snapshot(s) if s.entity_id == id => Some(s.state.clone()),
            _ => None,
        })
        .expect("a snapshot");
    SampleSnapshot::decode(&state).expect("decodable")
}

fn ack_of(out: &[Body], id: u64) -> Option<(u64, u64)> {
    out.iter().rev().find_map(|b| match b {
        Body::Update(u) if u.entity_id == id => u
            .changed
            .iter()
            .find(|c| c.r#type == schema::INPUT_ACK)
            .and_then(|c| schema::parse_input_ack(&c.payload)),
        _ => None,
    })
}

fn join(a: &mut Arena, account: &str, epoch: u64) -> u64 {
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::PlayerJoin(PlayerJoin {
            account: account.into(),
            session_epoch: epoch,
            last_position: None,
        }),
    );
    spawned(&out)[0]
}

fn input(account: &str, epoch: u64, seq: u64, dx: f32, dy: f32) -> sidecar_message::Body {
    M::Input(Input {
        account: account.into(),
        session_epoch: epoch,
        seq,
        payload: schema::input(dx, dy),
    })
}

fn freeze(a: &mut Arena, id: u64, epoch: u64) -> Vec<Body> {
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::Freeze(Freeze {
            entity_id: id,
            entity_epoch: epoch,
        }),
    );
    out
}

fn adopt_msg(id: u64, epoch: u64, s: &SampleSnapshot, owner: &str) -> Adopt {
    Adopt {
        entity_id: id,
        entity_epoch: epoch,
        position: Some(Vec3 {
            x: s.pos[0],
            y: s.pos[1],
            z: s.pos[2],
        }),
        state: s.encode(),
        owner_account: owner.into(),
        is_master: s.kind == SnapshotKind::Player,
        attachments: vec![],
    }
}

fn player_snapshot(account: &str, last_seq: u64, applied: u64) -> SampleSnapshot {
    SampleSnapshot {
        v: SNAPSHOT_VERSION,
        kind: SnapshotKind::Player,
        name: account.into(),
        pos: [999.0, 500.0, 0.0],
        dir: [0.0, 0.0],
        health: [80, 100],
        inventory: "sword".into(),
        session_epoch: 2,
        last_seq,
        applied,
        turn_in: 0,
        damage: vec![],
        xp: 0,
    }
}

#[test]
fn torus_takes_the_short_way_round() {
    let t = Torus { w: SIZE, h: SIZE };
    assert_eq!(t.delta((990.0, 10.0), (10.0, 990.0)), (20.0, -20.0));
    assert_eq!(t.normalise((-1.0, 1001.0)), (999.0, 1.0));
    assert_eq!(t.normalise((-1e-18, 0.0)).0, 0.0);
    let flat = Torus::default();
    assert_eq!(flat.delta((990.0, 0.0), (10.0, 0.0)), (-980.0, 0.0));
}

/// A player of this arena standing still at `at`.
fn join_at(a: &mut Arena, account: &str, at: (f64, f64)) -> u64 {
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::PlayerJoin(PlayerJoin {
            account: account.into(),
            session_epoch: 1,
            last_position: Some(Vec3::xy(at.0, at.1)),
        }),
    );
    spawned(&out)[0]
}

/// A player of another node, as this arena sees its ghost.
fn player_ghost(id: u64, account: &str, at: (f64, f64)) -> M {
    M::GhostEnter(GhostEnter {
        entity_id: id,
        position: Some(Vec3::xy(at.0, at.1)),
        components: vec![component(
            schema::KIND,
            Bytes::from(format!("player:{account}")),
            public(),
        )],
    })
}

fn tick_n(a: &mut Arena, n: u64) -> Vec<Body> {
    let mut out = Vec::new();
    for _ in 0..n {
        a.tick(&mut out, 0.05);
    }
    out
}

fn attack_in(target: u64, account: &str, avatar: u64, from_node: u32, request_id: u64) -> M {
    M::CommandIn(CommandIn {
        target,
        from_entity: avatar,
        from_account: account.into(),
        r#type: combat::CMD_ATTACK,
        payload: combat::encode(combat::DAMAGE, request_id),
        request_id,
        from_node,
    })
}
