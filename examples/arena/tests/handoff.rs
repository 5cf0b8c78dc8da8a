//! The arena over a real socket, against a test that plays its sidecar: the handoff contract as
//! the game sees it (freeze, snapshot, evict, adopt, inputs that carry on).

use std::collections::VecDeque;
use std::sync::Arc;

use cellmesh_arena::schema::{self, SampleSnapshot, SnapshotKind, SNAPSHOT_VERSION};
use cellmesh_arena::{ArenaConfig, ArenaStats, Census};
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::local::{
    game_message::Body, sidecar_message::Body as M, Adopt, Evict, Freeze, GameFrame, IdsReserved,
    Input, PlayerJoin, PlayerLeave, SidecarFrame, Vec3, Welcome, WorldShape,
};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{within, PATIENCE};
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::codec::Framed;

const NODE: u32 = 9;
const SIZE: f64 = 1000.0;

/// The sidecar's end of the local protocol.
struct Sidecar {
    io: Framed<TcpStream, FrameCodec<GameFrame>>,
    /// Messages of frames read but not yet looked at.
    unread: VecDeque<Body>,
}

impl Sidecar {
    async fn send(&mut self, body: M) {
        let frame = SidecarFrame {
            messages: vec![body.into()],
        };
        self.io.send(frame).await.unwrap();
    }

    async fn next(&mut self) -> Body {
        loop {
            if let Some(b) = self.unread.pop_front() {
                return b;
            }
            let frame = within("a frame from the arena", self.io.next())
                .await
                .expect("the arena is connected")
                .unwrap();
            self.unread
                .extend(frame.messages.into_iter().filter_map(|m| m.body));
        }
    }

    /// Reads until a message `pick` accepts; what was read before it is returned too.
    async fn until<T>(&mut self, mut pick: impl FnMut(&Body) -> Option<T>) -> (T, Vec<Body>) {
        let mut seen = Vec::new();
        loop {
            let b = self.next().await;
            if let Some(t) = pick(&b) {
                return (t, seen);
            }
            seen.push(b);
        }
    }

    /// The messages up to and including the `n`th next TickEnd.
    async fn ticks(&mut self, n: usize) -> Vec<Body> {
        let mut out = Vec::new();
        let mut ends = 0;
        while ends < n {
            let b = self.next().await;
            ends += matches!(b, Body::TickEnd(_)) as usize;
            out.push(b);
        }
        out
    }
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

fn input(account: &str, session_epoch: u64, seq: u64, dx: f32, dy: f32) -> M {
    M::Input(Input {
        account: account.into(),
        session_epoch,
        seq,
        payload: schema::input(dx, dy),
    })
}

fn ack(b: &Body, id: u64) -> Option<(u64, u64)> {
    match b {
        Body::Update(u) if u.entity_id == id => u
            .changed
            .iter()
            .find(|c| c.r#type == schema::INPUT_ACK)
            .and_then(|c| schema::parse_input_ack(&c.payload)),
        _ => None,
    }
}

/// Starts an arena against a fresh listener and answers its hello and first id request.
async fn start(
    npcs: u32,
    census: &Arc<Census>,
) -> (
    Sidecar,
    oneshot::Sender<()>,
    JoinHandle<anyhow::Result<ArenaStats>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(listener.local_addr().unwrap().to_string()),
        npcs,
        // On the corner of the torus, so NPCs wander across both seams.
        center: (0.0, 0.0),
        spread: 20.0,
        player_speed: 200.0,
        census: Some(census.clone()),
        ..ArenaConfig::default()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let arena = tokio::spawn(cellmesh_arena::run(cfg, async move {
        let _ = stopped.await;
    }));
    let (socket, _) = within("the arena to connect", listener.accept())
        .await
        .unwrap();
    let mut sc = Sidecar {
        io: Framed::new(socket, FrameCodec::default()),
        unread: VecDeque::new(),
    };
    let hello = sc.next().await;
    assert!(matches!(hello, Body::Hello(_)), "{hello:?}");
    sc.send(M::Welcome(Welcome {
        node_id: NODE,
        world: Some(WorldShape {
            width: SIZE,
            height: SIZE,
            chunk_size: 32.0,
            region_size: 500.0,
        }),
        ..Default::default()
    }))
    .await;
    let (request_id, _) = sc
        .until(|b| match b {
            Body::ReserveIds(r) => Some(r.request_id),
            _ => None,
        })
        .await;
    sc.send(M::IdsReserved(IdsReserved {
        request_id,
        ids: (1..=600).collect(),
    }))
    .await;
    (sc, stop, arena)
}

#[tokio::test]
async fn a_frozen_npc_is_snapshotted_and_an_evicted_one_never_despawned() {
    let census = Arc::new(Census::default());
    let (mut sc, stop, arena) = start(3, &census).await;
    let mut npcs = Vec::new();
    while npcs.len() < 3 {
        if let Body::Spawn(s) = sc.next().await {
            npcs.push(s.entity_id);
        }
    }
    let id = npcs[0];
    sc.send(M::Freeze(Freeze {
        entity_id: id,
        entity_epoch: 6,
    }))
    .await;
    let (snapshot, _) = sc
        .until(|b| match b {
            Body::Snapshot(s) => Some(s.clone()),
            _ => None,
        })
        .await;
    assert_eq!((snapshot.entity_id, snapshot.entity_epoch), (id, 6));
    let state = SampleSnapshot::decode(&snapshot.state).expect("a sample snapshot");
    assert_eq!((state.v, state.kind), (SNAPSHOT_VERSION, SnapshotKind::Npc));
    assert!(state.name.starts_with("wanderer-"));
    assert!(state.pos[..2].iter().all(|c| (0.0..SIZE).contains(c)));

    let after = sc.ticks(5).await;
    assert!(!writes(&after, id), "a frozen entity is not written");
    assert!(writes(&after, npcs[1]), "the others still move");

    sc.send(M::Evict(Evict { entity_id: id })).await;
    // The census tells when the arena has read the eviction.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while census.report().holders.contains_key(&id) {
        assert!(tokio::time::Instant::now() < deadline, "evict not seen");
        sc.ticks(1).await;
    }
    let after = sc.ticks(5).await;
    assert!(!writes(&after, id), "no despawn, no update: {after:?}");
    assert_eq!(census.report().lost(), vec![id]);

    // A player's avatar: once evicted, its account's leave is not this arena's to act on.
    sc.send(M::PlayerJoin(PlayerJoin {
        account: "ann".into(),
        session_epoch: 1,
        last_position: None,
    }))
    .await;
    let (ann, _) = sc
        .until(|b| match b {
            Body::Spawn(s) if s.owner_account == "ann" => Some(s.entity_id),
            _ => None,
        })
        .await;
    sc.send(M::Freeze(Freeze {
        entity_id: ann,
        entity_epoch: 1,
    }))
    .await;
    sc.send(M::Evict(Evict { entity_id: ann })).await;
    sc.send(M::PlayerLeave(PlayerLeave {
        account: "ann".into(),
        session_epoch: 1,
        reason: "bye".into(),
    }))
    .await;
    let (snapshot, _) = sc
        .until(|b| match b {
            Body::Snapshot(s) => Some(s.clone()),
            _ => None,
        })
        .await;
    let state = SampleSnapshot::decode(&snapshot.state).unwrap();
    assert_eq!(
        (state.kind, state.name.as_str()),
        (SnapshotKind::Player, "ann")
    );
    let after = sc.ticks(5).await;
    assert!(
        !writes(&after, ann),
        "no despawn of an evicted avatar: {after:?}"
    );
    let mut evicted = vec![id, ann];
    evicted.sort_unstable();
    assert_eq!(
        census.report().lost(),
        evicted,
        "held by nobody until adopted elsewhere"
    );

    stop.send(()).unwrap();
    let stats = arena.await.unwrap().unwrap();
    assert_eq!(
        (stats.frozen, stats.snapshots, stats.evicted),
        (2, 2, 2),
        "{stats:?}"
    );
    assert!(
        census.report().holders.is_empty(),
        "a stopped arena holds nothing"
    );
}

#[tokio::test]
async fn an_adopted_player_carries_on_its_input_sequence_across_the_seam() {
    let census = Arc::new(Census::default());
    let (mut sc, stop, arena) = start(0, &census).await;
    let id = 5_000_001;
    let state = SampleSnapshot {
        damage: vec![],
        xp: 0,
        v: SNAPSHOT_VERSION,
        kind: SnapshotKind::Player,
        name: "bob".into(),
        pos: [999.0, 500.0, 2.0],
        dir: [0.0, 0.0],
        health: [70, 100],
        inventory: "sword,bread,10 gold".into(),
        session_epoch: 3,
        last_seq: 10,
        applied: 8,
        turn_in: 0,
    };
    let adopt = Adopt {
        entity_id: id,
        entity_epoch: 2,
        position: Some(Vec3 {
            x: 999.0,
            y: 500.0,
            z: 2.0,
        }),
        state: state.encode(),
        owner_account: "bob".into(),
        is_master: true,
        attachments: vec![],
    };
    sc.send(M::Adopt(adopt.clone())).await;
    let (adopted, seen) = sc
        .until(|b| match b {
            Body::Adopted(a) => Some(*a),
            _ => None,
        })
        .await;
    assert_eq!((adopted.entity_id, adopted.entity_epoch), (id, 2));
    assert!(!writes(&seen, id));
    let (first_ack, _) = sc.until(|b| ack(b, id)).await;
    assert_eq!(first_ack, (10, 8), "the acknowledgement carries on");

    // 11 is new; 10 and a second 11 are duplicates. East, across the seam at x = 1000.
    sc.send(input("bob", 3, 11, 1.0, 0.0)).await;
    sc.send(input("bob", 3, 10, -1.0, 0.0)).await;
    sc.send(input("bob", 3, 11, -1.0, 0.0)).await;
    let (next_ack, _) = sc.until(|b| ack(b, id)).await;
    assert_eq!(next_ack, (11, 9));
    let moves = sc.ticks(5).await;
    let xs: Vec<f64> = moves
        .iter()
        .filter_map(|b| match b {
            Body::Update(u) if u.entity_id == id => u.position.map(|p| p.x),
            _ => None,
        })
        .collect();
    assert!(!xs.is_empty());
    assert!(
        xs.iter().all(|x| (0.0..100.0).contains(x)),
        "walked east over the seam, positions normalised: {xs:?}"
    );

    // A replayed Adopt is answered again and makes no second copy.
    sc.send(M::Adopt(adopt)).await;
    sc.until(|b| matches!(b, Body::Adopted(a) if a.entity_id == id).then_some(()))
        .await;
    assert_eq!(census.report().holders.get(&id), Some(&vec![NODE]));

    // Frozen: inputs that slip through are ignored.
    sc.send(M::Freeze(Freeze {
        entity_id: id,
        entity_epoch: 2,
    }))
    .await;
    sc.send(input("bob", 3, 12, 0.0, 1.0)).await;
    let (snapshot, _) = sc
        .until(|b| match b {
            Body::Snapshot(s) => Some(s.clone()),
            _ => None,
        })
        .await;
    let frozen = SampleSnapshot::decode(&snapshot.state).unwrap();
    assert_eq!(
        (
            frozen.name.as_str(),
            frozen.session_epoch,
            frozen.last_seq,
            frozen.applied
        ),
        ("bob", 3, 11, 9)
    );
    assert_eq!(
        (frozen.health, frozen.inventory.as_str()),
        ([70, 100], "sword,bread,10 gold")
    );
    assert_eq!(frozen.dir, [1.0, 0.0]);
    assert!(!writes(&sc.ticks(3).await, id));

    stop.send(()).unwrap();
    let stats = arena.await.unwrap().unwrap();
    assert_eq!(
        (
            stats.adopted,
            stats.inputs_applied,
            stats.inputs_duplicate,
            stats.inputs_while_frozen
        ),
        (1, 1, 2, 1),
        "{stats:?}"
    );
}
