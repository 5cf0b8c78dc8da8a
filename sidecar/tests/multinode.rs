//! Several nodes serving one world, over real sockets: sidecars linked to each other over
//! loopback TCP, a game on each (the test drives them), and clients logged in through real
//! proxies in front of them.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::edge::{self, DeltaKind, KickReason};
use cellmesh_proto::local::{self, game_message, sidecar_message, AudienceKind};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::{PlayerRecord, Stores};
use cellmesh_test_support::{required, run_id};
use cellmesh_world::geometry::{Pos, WorldShape};
use cellmesh_world::partition::{Grid, Layout, Partition};
use support::*;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A cell of 32 x 32 chunks per node.
const CELL: f64 = 1024.0;
/// Polling rounds before a wait gives up (each ticks every game once).
const ROUNDS: usize = 200;

struct TestNode {
    handle: Option<SidecarHandle>,
    stop: CancellationToken,
    game: TestGame,
    ids: Vec<u64>,
}

impl TestNode {
    fn h(&self) -> &SidecarHandle {
        self.handle.as_ref().expect("running")
    }

    fn id(&mut self) -> u64 {
        self.ids.pop().expect("enough ids")
    }

    async fn metrics(&self) -> String {
        let (_, body) = cellmesh_admin::http_get(self.h().admin_addr, "/metrics")
            .await
            .expect("metrics");
        body
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// `cols × rows` nodes (ids 1, 2, … row by row), one cell each, linked to each other.
struct World {
    shape: WorldShape,
    nodes: BTreeMap<u32, TestNode>,
    tick: u64,
}

fn config(node_id: u32, shape: WorldShape) -> SidecarConfig {
    SidecarConfig {
        node_id,
        world: shape,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        attest_keys: vec![attest_key()],
        ghost_min_lifespan_ms: 300,
        // Nodes of parallel tests share this process and their ids: none locks a state dir.
        state_dir: String::new(),
        ..SidecarConfig::default()
    }
}

impl World {
    async fn start(cols: u32, rows: u32) -> Self {
        Self::start_with(cols, rows, Stores::in_memory(), |_| None).await
    }

    async fn start_with(
        cols: u32,
        rows: u32,
        stores: Stores,
        advertise: impl Fn(u32) -> Option<String>,
    ) -> Self {
        let w = Self::start_unlinked(cols, rows, stores, advertise).await;
        w.linked().await;
        w
    }

    /// `advertise(node)` may give the address peers should dial for that node.
    async fn start_unlinked(
        cols: u32,
        rows: u32,
        stores: Stores,
        advertise: impl Fn(u32) -> Option<String>,
    ) -> Self {
        let shape = WorldShape {
            width: cols as f64 * CELL,
            height: rows as f64 * CELL,
            chunk_size: CHUNK,
            region_size: CELL,
        };
        let ids: Vec<u32> = (1..=cols * rows).collect();
        let grid = Grid::new(&shape, cols, rows, ids.clone()).unwrap();
        let partition = Partition::new(shape, 1, Layout::Grid(grid)).unwrap();
        let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
        topology.commit_partition(0, &partition).await.unwrap();
        let mut nodes = BTreeMap::new();
        for id in ids {
            let mut cfg = config(id, shape);
            if let Some(a) = advertise(id) {
                cfg.mesh_advertise = a;
            }
            let stop = CancellationToken::new();
            let handle =
                cellmesh_sidecar::start_in(cfg, stores.clone(), topology.clone(), stop.clone())
                    .await
                    .expect("node starts");
            let mut game = TestGame::connect(&handle.local_addr).await;
            let ids = game.reserve(512).await;
            nodes.insert(
                id,
                TestNode {
                    handle: Some(handle),
                    stop,
                    game,
                    ids,
                },
            );
        }
        Self {
            shape,
            nodes,
            tick: 0,
        }
    }

    /// Waits until every node has a link up to every other.
    async fn linked(&self) {
        let n = self.nodes.len() as u64 - 1;
        within("every peer link up", async {
            while !self.nodes.values().all(|x| x.h().stats().peers_up == n) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }

    fn node(&mut self, id: u32) -> &mut TestNode {
        self.nodes.get_mut(&id).expect("a node of this world")
    }

    /// Ends a tick on every game.
    async fn tick(&mut self) {
        self.tick += 1;
        let t = self.tick;
        for n in self.nodes.values_mut() {
            n.game.tick(t).await;
        }
    }

    /// Ticks every game until a batch of player `player` of `proxy` satisfies `f`.
    async fn until<T>(
        &mut self,
        proxy: &mut Edge,
        player: u64,
        what: &str,
        mut f: impl FnMut(&edge::Batch) -> Option<T>,
    ) -> T {
        for _ in 0..ROUNDS {
            self.tick().await;
            for b in proxy
                .batches_within(player, Duration::from_millis(25))
                .await
            {
                if let Some(t) = f(&b) {
                    return t;
                }
            }
        }
        panic!("player {player} never got {what}");
    }

    /// Logs `account` in as player `player` of `proxy`, whose gateway is `node`, and spawns its
    /// avatar there at `at`.
    async fn join(
        &mut self,
        node: u32,
        proxy: &mut Edge,
        player: u64,
        account: &str,
        at: local::Vec3,
    ) -> u64 {
        let attached = proxy.login(player, account).await;
        assert_eq!(attached.gateway_node, node);
        let n = self.node(node);
        let join = n.game.expect_join(account).await;
        assert_eq!(join.session_epoch, attached.session_epoch);
        let id = n.id();
        n.game.push(avatar(
            id,
            account,
            at,
            vec![comp(3, "inventory", aud(AudienceKind::OwnerOnly, &[]))],
        ));
        id
    }
}

fn appeared(b: &edge::Batch, id: u64) -> Option<edge::EntityDelta> {
    b.deltas
        .iter()
        .find(|d| d.entity_id == id && d.kind() == DeltaKind::Appear)
        .cloned()
}

fn has(b: &edge::Batch, id: u64, kind: DeltaKind) -> bool {
    b.deltas
        .iter()
        .any(|d| d.entity_id == id && d.kind() == kind)
}

/// An NPC with a public kind, public health and an owner-only secret (nobody may see it).
fn npc_with_secret(id: u64, at: local::Vec3) -> game_message::Body {
    game_message::Body::Spawn(local::Spawn {
        entity_id: id,
        position: Some(at),
        components: vec![
            comp(1, "npc", aud(AudienceKind::PublicInRange, &[])),
            comp(2, "hp", aud(AudienceKind::PublicInRange, &[])),
            comp(3, "secret", aud(AudienceKind::OwnerOnly, &[])),
        ],
        ..Default::default()
    })
}

async fn sees_remote_npc_appear_move_vanish(cols: u32, rows: u32) {
    let mut w = World::start(cols, rows).await;
    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    // Alice stands in node 1's cell two chunks from node 2's.
    let me = w.join(1, &mut edge, 1, "alice", chunk(30, 10)).await;
    let npc = w.node(2).id();
    w.node(2).game.push(npc_with_secret(npc, chunk(33, 10)));
    let first = w
        .until(&mut edge, 1, "the NPC of node 2", |b| appeared(b, npc))
        .await;
    assert_eq!(
        types(&first),
        [1, 2],
        "public components only, never the secret"
    );
    let p = first.position.unwrap();
    assert_eq!((p.x, p.y), (33.0 * CHUNK + 16.0, 10.0 * CHUNK + 16.0));
    assert_eq!(first.owner_account, "");

    w.node(2).game.push(move_to(npc, chunk(34, 10)));
    let moved = w
        .until(&mut edge, 1, "the NPC's move", |b| {
            b.deltas
                .iter()
                .find(|d| d.entity_id == npc && d.kind() == DeltaKind::Update)
                .cloned()
        })
        .await;
    assert_eq!(moved.position.unwrap().x, 34.0 * CHUNK + 16.0);
    assert!(moved.components.is_empty());

    w.node(2).game.push(change(
        npc,
        comp(3, "secret-2", aud(AudienceKind::OwnerOnly, &[])),
    ));
    w.node(2).game.push(despawn(npc));
    let gone = w
        .until(&mut edge, 1, "the NPC's vanish", |b| {
            for d in &b.deltas {
                assert!(
                    !d.components.iter().any(|c| c.r#type == 3),
                    "an owner-only component leaked: {d:?}"
                );
            }
            has(b, npc, DeltaKind::Vanish).then_some(())
        })
        .await;
    let _ = (gone, me);
    assert_eq!(
        w.node(1).h().stats().ghosts_render,
        0,
        "the ghost is gone too"
    );
}

#[tokio::test]
async fn two_nodes_a_client_sees_a_remote_npc_appear_move_and_vanish() {
    sees_remote_npc_appear_move_vanish(2, 1).await;
}

#[tokio::test]
async fn four_nodes_a_client_sees_a_remote_npc_appear_move_and_vanish() {
    sees_remote_npc_appear_move_vanish(2, 2).await;
}

#[tokio::test]
async fn thirty_watchers_on_one_gateway_cost_the_owner_one_message_per_update() {
    let mut w = World::start(2, 1).await;
    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    for s in 1..=30u64 {
        w.join(
            1,
            &mut edge,
            s,
            &format!("watcher-{s}"),
            chunk(30, 8 + (s % 5) as i64),
        )
        .await;
    }
    let npc = w.node(2).id();
    w.node(2).game.push(npc_with_secret(npc, chunk(33, 10)));
    let mut waiting: BTreeSet<u64> = (1..=30).collect();
    for _ in 0..ROUNDS {
        w.tick().await;
        for s in waiting.clone() {
            if edge
                .batches_within(s, Duration::from_millis(2))
                .await
                .iter()
                .any(|b| appeared(b, npc).is_some())
            {
                waiting.remove(&s);
            }
        }
        if waiting.is_empty() {
            break;
        }
    }
    assert!(waiting.is_empty(), "never saw the NPC: {waiting:?}");
    edge.settle(Duration::from_millis(100)).await;

    let before = w.node(2).h().stats().cross_node_updates;
    const MOVES: u64 = 5;
    let x = |i: u64| 33.0 * CHUNK + 2.0 + i as f64;
    for i in 1..=MOVES {
        w.node(2)
            .game
            .push(move_to(npc, local::Vec3::xy(x(i), 10.0 * CHUNK)));
        w.tick().await;
    }
    // Every watcher follows the NPC to where it stopped (moves between two of the gateway's
    // ticks fold into one update)...
    let mut last: BTreeMap<u64, f64> = BTreeMap::new();
    for _ in 0..50 {
        for s in 1..=30u64 {
            for b in edge.batches_within(s, Duration::from_millis(1)).await {
                for d in b.deltas.iter().filter(|d| d.entity_id == npc) {
                    assert_eq!(d.kind(), DeltaKind::Update);
                    last.insert(s, d.position.unwrap().x);
                }
            }
        }
        if last.len() == 30 && last.values().all(|v| *v == x(MOVES)) {
            break;
        }
        w.tick().await;
    }
    assert!(
        last.len() == 30 && last.values().all(|v| *v == x(MOVES)),
        "{last:?}"
    );
    // ...and the owner sent each one once, to the one subscribed node.
    let sent = w.node(2).h().stats().cross_node_updates - before;
    assert_eq!(sent, MOVES, "one entity frame per update to node 1");
}

#[tokio::test]
async fn a_party_over_three_gateways_costs_three_node_messages() {
    let mut w = World::start(2, 2).await;
    let mut edges = Vec::new();
    for (node, account) in [(1u32, "alice"), (2, "bob"), (3, "carol")] {
        let mut edge = Edge::start("edge", &[w.node(node).h().mesh_addr]).await;
        // Deep inside each gateway's own cell, far from node 4's.
        let at = match node {
            1 => chunk(5, 5),
            2 => chunk(40, 5),
            _ => chunk(5, 40),
        };
        w.join(node, &mut edge, 1, account, at).await;
        edges.push(edge);
    }
    // Node 4 simulates something of alice's whose health her party sees.
    let pet = w.node(4).id();
    w.node(4).game.push(game_message::Body::Spawn(local::Spawn {
        entity_id: pet,
        position: Some(chunk(50, 50)),
        components: vec![
            comp(1, "pet", aud(AudienceKind::PublicInRange, &[])),
            comp(
                2,
                "hp-100",
                aud(AudienceKind::OwnerAndParty, &["bob", "carol"]),
            ),
        ],
        owner_account: "alice".into(),
        ..Default::default()
    }));
    for edge in edges.iter_mut() {
        w.until(edge, 1, "the pet's health", |b| {
            b.deltas
                .iter()
                .any(|d| d.entity_id == pet && types(d) == [2])
                .then_some(())
        })
        .await;
    }
    let before = w.node(4).h().stats().routed_messages;
    w.node(4).game.push(change(
        pet,
        comp(
            2,
            "hp-90",
            aud(AudienceKind::OwnerAndParty, &["bob", "carol"]),
        ),
    ));
    for edge in edges.iter_mut() {
        let d = w
            .until(edge, 1, "the health change", |b| {
                b.deltas.iter().find(|d| d.entity_id == pet).cloned()
            })
            .await;
        assert_eq!(d.components[0].payload, Bytes::from_static(b"hp-90"));
        assert_eq!(
            d.kind(),
            DeltaKind::Update,
            "not in view: an update, never the public kind"
        );
        assert_eq!(types(&d), [2]);
    }
    assert_eq!(w.node(4).h().stats().routed_messages - before, 3);
    let m = w.node(4).metrics().await;
    assert!(
        m.contains("cellmesh_sidecar_routed_by_audience_total{audience=\"owner_and_party\"}"),
        "{m}"
    );

    // A message for an account nobody holds is dropped and counted.
    w.node(4).game.push(game_message::Body::Send(local::Send {
        accounts: vec!["nobody".into()],
        r#type: 7,
        payload: Bytes::from_static(b"hi"),
    }));
    for _ in 0..ROUNDS {
        w.tick().await;
        if w.node(4).h().stats().dropped_unknown_account == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(w.node(4).h().stats().dropped_unknown_account, 1);
}

#[tokio::test]
async fn a_player_simulated_off_its_gateway_sees_its_own_inventory_with_its_avatar() {
    // Alice last stood just inside node 2's cell, so node 2 spawns her avatar while her
    // gateway is node 1.
    let stores = Stores::in_memory();
    let home = chunk(36, 5);
    stores
        .players
        .save(&PlayerRecord {
            account: "alice".into(),
            last_position: Some([home.x, home.y, home.z]),
            updated_unix_ms: 1,
            ..PlayerRecord::default()
        })
        .await
        .unwrap();
    let mut w = World::start_with(2, 1, stores, |_| None).await;
    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    assert_eq!(edge.login(1, "alice").await.gateway_node, 1);
    let join = w.node(2).game.expect_join("alice").await;
    let at = join.last_position.expect("the record's position");
    let avatar_id = w.node(2).id();
    w.node(2).game.push(avatar(
        avatar_id,
        "alice",
        at,
        vec![comp(3, "alice-inv", aud(AudienceKind::OwnerOnly, &[]))],
    ));

    // Her client mirrors what it is told: an APPEAR replaces what it held of the entity.
    let mut held: Option<BTreeSet<u32>> = None;
    for _ in 0..ROUNDS {
        w.tick().await;
        for b in edge.batches_within(1, Duration::from_millis(25)).await {
            for d in b.deltas.iter().filter(|d| d.entity_id == avatar_id) {
                let types = types(d).into_iter();
                match d.kind() {
                    DeltaKind::Appear => held = Some(types.collect()),
                    DeltaKind::Update => {
                        if let Some(h) = held.as_mut() {
                            h.extend(types);
                        }
                    }
                    DeltaKind::Vanish => held = None,
                }
            }
        }
        if held.as_ref().is_some_and(|h| h.contains(&3)) {
            break;
        }
    }
    let held = held.expect("alice saw her avatar appear");
    assert!(
        held.contains(&3),
        "no inventory with or after the appear: {held:?}"
    );

    // Bob, on the same gateway across the border, sees her avatar but never her inventory.
    w.join(1, &mut edge, 2, "bob", chunk(31, 5)).await;
    let appear = w
        .until(&mut edge, 2, "alice's avatar", |b| appeared(b, avatar_id))
        .await;
    assert_eq!(types(&appear), [1]);
    for _ in 0..10 {
        w.tick().await;
        for b in edge.batches_within(2, Duration::from_millis(25)).await {
            for d in b.deltas.iter().filter(|d| d.entity_id == avatar_id) {
                assert!(!types(d).contains(&3), "bob got alice's inventory: {d:?}");
            }
        }
        // Nor is it sent to alice again while it does not change.
        for b in edge.batches_within(1, Duration::ZERO).await {
            assert!(b.deltas.iter().all(|d| d.entity_id != avatar_id), "{b:?}");
        }
    }
}

#[tokio::test]
async fn a_party_member_logging_in_elsewhere_gets_the_current_party_state_once() {
    let mut w = World::start(2, 1).await;
    // Alice's pet lives on node 2 before anyone of her party is logged in.
    let pet = w.node(2).id();
    w.node(2).game.push(game_message::Body::Spawn(local::Spawn {
        entity_id: pet,
        position: Some(chunk(50, 5)),
        components: vec![
            comp(1, "pet", aud(AudienceKind::PublicInRange, &[])),
            comp(2, "hp-100", aud(AudienceKind::OwnerAndParty, &["bob"])),
        ],
        owner_account: "alice".into(),
        ..Default::default()
    }));
    for _ in 0..3 {
        w.tick().await;
    }
    // Bob logs in on node 1, far from the pet: it reaches him though nothing changed.
    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    w.join(1, &mut edge, 1, "bob", chunk(5, 5)).await;
    let d = w
        .until(&mut edge, 1, "the pet's health", |b| {
            b.deltas.iter().find(|d| d.entity_id == pet).cloned()
        })
        .await;
    assert_eq!((d.kind(), types(&d)), (DeltaKind::Update, vec![2]));
    assert_eq!(d.components[0].payload, Bytes::from_static(b"hp-100"));
    for _ in 0..10 {
        w.tick().await;
        for b in edge.batches_within(1, Duration::from_millis(25)).await {
            assert!(b.deltas.iter().all(|d| d.entity_id != pet), "{b:?}");
        }
    }
}

#[tokio::test]
async fn a_send_reaches_an_account_on_another_gateway() {
    let mut w = World::start(2, 1).await;
    let mut edge = Edge::start("edge", &[w.node(2).h().mesh_addr]).await;
    w.join(2, &mut edge, 1, "bob", chunk(40, 5)).await;
    w.node(1).game.push(game_message::Body::Send(local::Send {
        accounts: vec!["bob".into()],
        r#type: 42,
        payload: Bytes::from_static(b"trade?"),
    }));
    let m = w
        .until(&mut edge, 1, "the message", |b| b.messages.first().cloned())
        .await;
    assert_eq!((m.r#type, m.payload), (42, Bytes::from_static(b"trade?")));
}

#[tokio::test]
async fn an_npc_perceives_a_player_across_the_border_without_flapping() {
    let mut w = World::start(2, 1).await;
    // A player on node 2 half a chunk across the border of node 1's cell (x = 32 chunks).
    let player = w.node(2).id();
    w.node(2).game.push(avatar(
        player,
        "walker",
        local::Vec3::xy(32.0 * CHUNK + 16.0, 10.0 * CHUNK),
        vec![comp(3, "inventory", aud(AudienceKind::OwnerOnly, &[]))],
    ));
    let mut enters = 0;
    let mut leaves = 0;
    let count = |msgs: Vec<sidecar_message::Body>, enters: &mut i32, leaves: &mut i32| {
        for m in msgs {
            match m {
                sidecar_message::Body::GhostEnter(g) => {
                    assert_eq!(g.entity_id, player);
                    assert!(
                        g.components.iter().all(|c| c.r#type != 3),
                        "owner-only state never reaches another game"
                    );
                    *enters += 1;
                }
                sidecar_message::Body::GhostLeave(g) => {
                    assert_eq!(g.entity_id, player);
                    *leaves += 1;
                }
                _ => {}
            }
        }
    };
    for _ in 0..ROUNDS {
        w.tick().await;
        let got = w.node(1).game.drain(Duration::from_millis(10)).await;
        count(got, &mut enters, &mut leaves);
        if enters > 0 {
            break;
        }
    }
    assert_eq!((enters, leaves), (1, 0), "a simulation ghost on node 1");
    assert_eq!(w.node(1).h().stats().ghosts_sim, 1);

    // Pacing along the band's edge (one and two chunks out), every tick for well over the
    // minimum lifespan: no flapping. (Crossing into node 1's cell is handoff, not built yet.)
    for i in 0..40 {
        let x = if i % 2 == 0 { 32.05 } else { 33.9 };
        w.node(2)
            .game
            .push(move_to(player, local::Vec3::xy(x * CHUNK, 10.0 * CHUNK)));
        w.tick().await;
        let got = w.node(1).game.drain(Duration::from_millis(15)).await;
        count(got, &mut enters, &mut leaves);
    }
    assert_eq!(
        (enters, leaves),
        (1, 0),
        "pacing must not create or destroy it"
    );

    // Walking away: the ghost leaves.
    w.node(2)
        .game
        .push(move_to(player, local::Vec3::xy(45.0 * CHUNK, 10.0 * CHUNK)));
    for _ in 0..ROUNDS {
        w.tick().await;
        let got = w.node(1).game.drain(Duration::from_millis(10)).await;
        count(got, &mut enters, &mut leaves);
        if leaves > 0 {
            break;
        }
    }
    assert_eq!((enters, leaves), (1, 1));
    assert_eq!(w.node(1).h().stats().ghosts_sim, 0);
}

#[tokio::test]
async fn across_the_seam_a_client_sees_both_sides_at_their_true_offsets() {
    let mut w = World::start(2, 1).await;
    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    let me_at = chunk(0, 10);
    w.join(1, &mut edge, 1, "alice", me_at).await;
    let west = w.node(2).id(); // last column of node 2's cell: across the seam
    let east = w.node(1).id();
    w.node(2).game.push(npc(west, chunk(63, 10)));
    w.node(1).game.push(npc(east, chunk(2, 10)));
    let mut seen: BTreeMap<u64, edge::Vec3> = BTreeMap::new();
    for _ in 0..ROUNDS {
        w.tick().await;
        for b in edge.batches_within(1, Duration::from_millis(20)).await {
            for d in &b.deltas {
                if d.kind() == DeltaKind::Appear {
                    if let Some(p) = d.position {
                        seen.insert(d.entity_id, p);
                    }
                }
            }
        }
        if seen.contains_key(&west) && seen.contains_key(&east) {
            break;
        }
    }
    let me = Pos {
        x: me_at.x,
        y: me_at.y,
    };
    let rel = |id: u64| {
        let p = seen
            .get(&id)
            .unwrap_or_else(|| panic!("{id} not seen: {seen:?}"));
        w.shape.delta(me, Pos { x: p.x, y: p.y })
    };
    assert_eq!(rel(west), (-CHUNK, 0.0), "one chunk west, across the seam");
    assert_eq!(rel(east), (2.0 * CHUNK, 0.0));
}

/// Alice logs in on gateway 1, then again on gateway 2: the second login wins, the first session
/// is kicked, and what is addressed to alice afterwards reaches the new session only.
async fn displacement(stores: Stores) {
    let mut w = World::start_with(2, 1, stores, |_| None).await;
    let mut l1 = Edge::start("edge-a", &[w.node(1).h().mesh_addr]).await;
    let mut l2 = Edge::start("edge-b", &[w.node(2).h().mesh_addr]).await;
    // Unique per run: the Redis directory outlives the test.
    let account = format!("alice-{}", run_id());
    w.join(1, &mut l1, 1, &account, chunk(5, 5)).await;
    let first = w
        .until(&mut l1, 1, "the first batch", |b| Some(b.tick))
        .await;
    assert!(first > 0);

    let attached = l2.login(1, &account).await;
    assert_eq!(attached.gateway_node, 2);
    let kicked = l1.kicked(1).await;
    assert_eq!(kicked.reason, KickReason::Displaced as i32);
    // One avatar per account: the new gateway found it in the directory's master record, so
    // node 1's game keeps it and hears the new session join; node 2's game spawns none, and the
    // old session's leave never reaches a game (it waits for, and is met by, the newer join).
    let join = w.node(1).game.expect_join(&account).await;
    assert_eq!(join.session_epoch, attached.session_epoch);
    let heard = w.node(2).game.drain(Duration::from_millis(300)).await;
    assert!(
        !heard
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerJoin(j) if j.account == account)),
        "{heard:?}"
    );

    // Node 1's game writes to the account: it reaches the session on gateway 2 only.
    w.node(1).game.push(game_message::Body::Send(local::Send {
        accounts: vec![account.clone()],
        r#type: 5,
        payload: Bytes::from_static(b"hello again"),
    }));
    let m = w
        .until(&mut l2, 1, "the message on the new session", |b| {
            b.messages.first().cloned()
        })
        .await;
    assert_eq!(m.payload, Bytes::from_static(b"hello again"));
    assert!(l1
        .batches_within(1, Duration::from_millis(200))
        .await
        .is_empty());
    let heard = w.node(1).game.drain(Duration::from_millis(3_500)).await;
    assert!(
        !heard
            .iter()
            .any(|m| matches!(m, sidecar_message::Body::PlayerLeave(_))),
        "{heard:?}"
    );
}

#[tokio::test]
async fn a_second_login_on_another_gateway_wins() {
    displacement(Stores::in_memory()).await;
}

#[tokio::test]
async fn the_session_directory_in_redis_routes_across_gateways() {
    let url = required("CELLMESH_TEST_REDIS_URL");
    let stores = Stores::open(&url, "memory", "test-multinode")
        .await
        .expect("Redis answers");
    displacement(stores).await;
}

/// A TCP relay in front of a node's mesh listener that can cut every connection through it.
struct Relay {
    addr: SocketAddr,
    target: Arc<Mutex<Option<SocketAddr>>>,
    open: Arc<Mutex<bool>>,
    cut: Arc<Mutex<CancellationToken>>,
}

impl Relay {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay = Self {
            addr: listener.local_addr().unwrap(),
            target: Arc::default(),
            open: Arc::new(Mutex::new(true)),
            cut: Arc::new(Mutex::new(CancellationToken::new())),
        };
        let (target, open, cut) = (relay.target.clone(), relay.open.clone(), relay.cut.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let to = *target.lock().unwrap();
                if !*open.lock().unwrap() || to.is_none() {
                    continue; // dropped: the dialler sees the connection close
                }
                let stop = cut.lock().unwrap().clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(to.unwrap()).await else {
                        return;
                    };
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        relay
    }

    fn cut(&self) {
        *self.open.lock().unwrap() = false;
        let mut c = self.cut.lock().unwrap();
        c.cancel();
        *c = CancellationToken::new();
    }

    fn restore(&self) {
        *self.open.lock().unwrap() = true;
    }
}

#[tokio::test]
async fn a_cut_link_resynchronises_without_duplicates_or_leaks() {
    let relay = Relay::start().await;
    let via = relay.addr.to_string();
    // Node 1 dials node 2 (the lower id dials), through the relay.
    let mut w = World::start_unlinked(2, 1, Stores::in_memory(), move |id| {
        (id == 2).then(|| via.clone())
    })
    .await;
    *relay.target.lock().unwrap() = Some(w.node(2).h().mesh_addr);
    w.linked().await;

    let mut edge = Edge::start("edge", &[w.node(1).h().mesh_addr]).await;
    w.join(1, &mut edge, 1, "alice", chunk(30, 10)).await;
    let npc = w.node(2).id();
    w.node(2).game.push(npc_with_secret(npc, chunk(33, 10)));
    w.until(&mut edge, 1, "the NPC", |b| appeared(b, npc)).await;
    let subscribers = w.node(2).h().stats().subscribers;
    let ghosts = w.node(1).h().stats().ghosts_render;
    assert!(subscribers > 0 && ghosts >= 1, "{subscribers} {ghosts}");

    relay.cut();
    // The link goes down: node 2 forgets node 1's subscriptions, and node 1 keeps the NPC as a
    // stale ghost, so the client sees no vanish.
    let mut seen = Vec::new();
    for _ in 0..ROUNDS {
        if w.node(2).h().stats().subscribers == 0 && w.node(1).h().stats().peers_up == 0 {
            break;
        }
        w.tick().await;
        seen.extend(edge.batches_within(1, Duration::from_millis(25)).await);
    }
    assert_eq!(w.node(2).h().stats().subscribers, 0);
    assert_eq!(
        w.node(1).h().stats().ghosts_render,
        ghosts,
        "the ghost stays"
    );

    // The NPC moves while the link is down; once restored, a fresh snapshot refreshes the ghost
    // in place: an update to where it is, not a vanish and a new appear.
    w.node(2).game.push(move_to(npc, chunk(34, 11)));
    for _ in 0..5 {
        w.tick().await;
        seen.extend(edge.batches_within(1, Duration::from_millis(25)).await);
    }
    relay.restore();
    let at = (34.0 * CHUNK + 16.0, 11.0 * CHUNK + 16.0);
    w.until(&mut edge, 1, "the NPC where it is after the restore", |b| {
        seen.push(b.clone());
        b.deltas
            .iter()
            .any(|d| d.entity_id == npc && d.position.as_ref().is_some_and(|p| (p.x, p.y) == at))
            .then_some(())
    })
    .await;
    assert!(
        seen.iter()
            .all(|b| !has(b, npc, DeltaKind::Vanish) && appeared(b, npc).is_none()),
        "the NPC vanished or appeared again through the outage: {seen:?}"
    );
    for _ in 0..3 {
        w.tick().await;
    }
    let later = edge.batches_within(1, Duration::from_millis(200)).await;
    assert!(
        later.iter().all(|b| appeared(b, npc).is_none()),
        "{later:?}"
    );
    assert_eq!(w.node(1).h().stats().ghosts_render, ghosts);
    assert_eq!(w.node(2).h().stats().subscribers, subscribers);
    let m = w.node(1).metrics().await;
    assert!(
        m.contains("cellmesh_sidecar_peer_links_established_total{peer=\"2\"} 2"),
        "{m}"
    );
}
