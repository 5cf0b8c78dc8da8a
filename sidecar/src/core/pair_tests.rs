//! Two cores wired back to back, each with a scripted game that answers freezes, adoptions and
//! commands as a game would, and one claim store for both: the harness of the command and claim
//! tests, in virtual time.

use std::sync::Arc;

use bytes::Bytes;
use cellmesh_proto::local::{self, game_message, sidecar_message};
use cellmesh_proto::mesh;
use cellmesh_stores::claims::ClaimTable;
use cellmesh_stores::topology::Lease;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, NodeId, Partition};

use super::*;

/// The link id each core numbers its one peer link with.
pub(super) const LINK: LinkId = 10;

/// One node and the game beside it, played by the test.
pub(super) struct Node {
    pub core: Core,
    pub id: NodeId,
    pub tick: u64,
    /// What the game sends in its next tick.
    pub queued: Vec<game_message::Body>,
    /// Every `CommandIn` the game was handed, in order.
    pub commands_in: Vec<local::CommandIn>,
    /// Every `CommandResult` the game was handed, in order.
    pub results: Vec<local::CommandResult>,
    /// Every `ClaimResult` the game was handed, in order.
    pub claim_results: Vec<local::ClaimResult>,
    /// Every `ClaimLost` the game was handed, with the time it was handed over.
    pub claims_lost: Vec<(u64, local::ClaimLost)>,
    /// Every `Error` the sidecar sent the game.
    pub errors: Vec<local::Error>,
    /// Every store call the core asked for, in order.
    pub store_asked: Vec<StoreRequest>,
    /// The core closed or cut the game's connection.
    pub game_cut: bool,
    /// Whether the game answers a `CommandIn` with a refusal.
    pub refuse: bool,
    /// Whether the game answers `Adopt` (false: the adoption hangs, as in a slow game).
    pub adopts: bool,
    /// Every `SpawnerOwned` the game was handed, in order.
    pub spawner_owned: Vec<local::SpawnerOwned>,
    /// Every `SpawnerReleased` the game was handed, in order.
    pub spawner_released: Vec<local::SpawnerReleased>,
    /// Whether the game spawns a stock as soon as it is handed one.
    pub stocks: bool,
}

/// Two nodes of one grid: node 1 owns x 0..256 m, node 2 the rest (16 x 16 chunks of 32 m).
pub(super) struct Pair {
    pub nodes: [Node; 2],
    pub now: u64,
    /// The geo's claim store, shared by both nodes, run at the harness's time.
    pub store: ClaimTable,
    /// The store answers every call with an error, and frees nothing.
    pub store_down: bool,
    /// Calls kept unanswered (by the node index that made them) while the store is slow: run
    /// in order by [`Pair::answer_store`].
    pub store_slow: Option<Vec<(usize, StoreRequest)>>,
    /// In two geos ([`Pair::in_two_geos`]): node 2's geo's store (`store` is node 1's).
    pub second_store: Option<ClaimTable>,
}

/// The geos of [`Pair::in_two_geos`]: node 1's, then node 2's.
pub(super) const GEOS: [&str; 2] = ["paris", "montreal"];

/// The protocol the scripted games speak: 1.7, whose handoffs go by the sidecar's `Freeze`
/// (what most of these tests look at). A game of 1.8 is asked to release instead (`Offload`);
/// the tests of that path say hello with the current protocol.
pub(super) const FREEZING_GAME: local::ProtocolVersion =
    local::ProtocolVersion { major: 1, minor: 7 };

pub(super) fn at(ms: u64) -> Now {
    Now {
        mono_ms: ms,
        unix_ms: 1_700_000_000_000 + ms,
    }
}

pub(super) fn pos(x: f64, y: f64) -> Option<local::Vec3> {
    Some(local::Vec3 { x, y, z: 0.0 })
}

impl Node {
    fn new(id: NodeId) -> Self {
        Self::configured(id, |_| {})
    }

    fn configured(id: NodeId, tweak: impl FnOnce(&mut SidecarConfig)) -> Self {
        let world = WorldShape {
            width: 512.0,
            height: 512.0,
            chunk_size: 32.0,
            region_size: 256.0,
        };
        let grid = Grid::even(&world, 2, 1, &[1, 2]).unwrap();
        let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
        let mut cfg = SidecarConfig {
            node_id: id,
            world,
            ..SidecarConfig::default()
        };
        tweak(&mut cfg);
        let lease = LeaseTerms {
            lease: Lease {
                node: id,
                holder: format!("node-{id}"),
                epoch: 1,
                expires_unix_ms: u64::MAX,
                ids_floor_unix_ms: 0,
            },
            until_ms: u64::MAX,
        };
        let mut core = Core::new(
            Arc::new(cfg),
            Metrics::default(),
            Arc::new(partition),
            true,
            Some(lease),
            at(0),
        );
        core.handle(
            at(0),
            Input::GameHello {
                conn: 1,
                hello: local::Hello {
                    version: Some(FREEZING_GAME),
                    tick_rate_hz: 20,
                    game: "test".into(),
                },
                rest: vec![],
            },
        );
        Node {
            core,
            id,
            tick: 0,
            queued: Vec::new(),
            commands_in: Vec::new(),
            results: Vec::new(),
            claim_results: Vec::new(),
            claims_lost: Vec::new(),
            errors: Vec::new(),
            store_asked: Vec::new(),
            game_cut: false,
            refuse: false,
            adopts: true,
            spawner_owned: Vec::new(),
            spawner_released: Vec::new(),
            stocks: true,
        }
    }

    /// Whether the node writes `id` (false: a ghost), and under which epoch.
    pub fn entity(&self, id: u64) -> Option<(bool, u64)> {
        self.core
            .table
            .get(id)
            .map(|e| (e.origin().is_none(), e.epoch))
    }

    /// Plays the game's side of what the sidecar handed it at `now`.
    fn play(&mut self, now: u64, frame: SidecarFrame) {
        for m in frame.messages {
            match m.body {
                Some(sidecar_message::Body::Freeze(f)) => {
                    self.queued
                        .push(game_message::Body::Snapshot(local::Snapshot {
                            entity_id: f.entity_id,
                            entity_epoch: f.entity_epoch,
                            state: Bytes::from_static(b"state"),
                        }))
                }
                Some(sidecar_message::Body::Adopt(a)) if self.adopts => {
                    self.queued
                        .push(game_message::Body::Adopted(local::Adopted {
                            entity_id: a.entity_id,
                            entity_epoch: a.entity_epoch,
                        }))
                }
                Some(sidecar_message::Body::CommandIn(c)) => {
                    if c.request_id != 0 {
                        self.queued
                            .push(game_message::Body::CommandReply(local::CommandReply {
                                request_id: c.request_id,
                                refused: self.refuse,
                                payload: Bytes::from(format!("done by {}", self.id)),
                                detail: String::new(),
                            }));
                    }
                    self.commands_in.push(c);
                }
                Some(sidecar_message::Body::CommandResult(r)) => self.results.push(r),
                Some(sidecar_message::Body::ClaimResult(r)) => self.claim_results.push(r),
                Some(sidecar_message::Body::ClaimLost(l)) => self.claims_lost.push((now, l)),
                Some(sidecar_message::Body::Error(e)) => self.errors.push(e),
                Some(sidecar_message::Body::SpawnerOwned(o)) => {
                    if self.stocks {
                        self.queued.push(game_message::Body::Spawn(local::Spawn {
                            entity_id: o.entity_id,
                            position: o.position,
                            ..Default::default()
                        }));
                    }
                    self.spawner_owned.push(o);
                }
                Some(sidecar_message::Body::SpawnerReleased(r)) => self.spawner_released.push(r),
                _ => {}
            }
        }
    }

    pub fn result_of(&self, request_id: u64) -> Vec<&local::CommandResult> {
        self.results
            .iter()
            .filter(|r| r.request_id == request_id)
            .collect()
    }

    /// The `ClaimResult`s answering `request_id`.
    pub fn claim_result_of(&self, request_id: u64) -> Vec<&local::ClaimResult> {
        self.claim_results
            .iter()
            .filter(|r| r.request_id == request_id)
            .collect()
    }
}

impl Pair {
    pub fn new() -> Self {
        Self::linked([Node::new(1), Node::new(2)], None)
    }

    /// Node 1 in geo `GEOS[0]`, node 2 in `GEOS[1]`, each geo with its own claim store; both
    /// list both geos as the world's (so each claim key has one home among them).
    pub fn in_two_geos() -> Self {
        let node = |id: NodeId| {
            Node::configured(id, |c| {
                c.geo = GEOS[id as usize - 1].into();
                c.geos = GEOS.iter().map(|g| g.to_string()).collect();
            })
        };
        Self::linked([node(1), node(2)], Some(ClaimTable::default()))
    }

    fn linked(nodes: [Node; 2], second_store: Option<ClaimTable>) -> Self {
        let mut p = Pair {
            nodes,
            now: 0,
            store: ClaimTable::default(),
            store_down: false,
            store_slow: None,
            second_store,
        };
        p.link_up();
        p
    }

    /// The link between the two nodes comes up (again), under id [`LINK`] on both sides.
    pub fn link_up(&mut self) {
        for (i, other) in [(0, 2u32), (1, 1)] {
            let geo = self.nodes[1 - i].core.cx.config.geo.clone();
            let geo = if geo == "local" { "test".into() } else { geo };
            self.nodes[i].core.handle(
                at(self.now),
                Input::LinkUp {
                    link: LINK,
                    hello: mesh::LinkHello {
                        version: Some(mesh::ProtocolVersion::current()),
                        role: mesh::PeerRole::Sidecar as i32,
                        id: other.to_string(),
                        geo,
                        partition_epoch: 1,
                        node_id: other,
                        lease_epoch: 1,
                        ..Default::default()
                    },
                    remote: format!("node-{other}"),
                    rest: vec![],
                },
            );
        }
    }

    /// The link between the two nodes drops, both sides see it.
    pub fn cut(&mut self) {
        for n in &mut self.nodes {
            n.core.handle(
                at(self.now),
                Input::LinkClosed {
                    link: LINK,
                    reason: "cut by the test".into(),
                },
            );
        }
    }

    pub fn node(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize - 1]
    }

    /// The game of node `id` sends `body` in its next tick.
    pub fn game_sends(&mut self, id: NodeId, body: game_message::Body) {
        self.node(id).queued.push(body);
    }

    /// One tick of 50 ms: each game sends what it queued, then every frame is carried to its
    /// peer (or game, or the store) until nothing is left, with no time passing in between.
    pub fn step(&mut self) {
        self.now += 50;
        for id in [1, 2] {
            self.tick_game(id);
        }
        self.carry();
    }

    /// Node `id`'s game sends its tick at the current time, and the core's timer runs; nothing
    /// is carried yet.
    pub fn tick_game(&mut self, id: NodeId) {
        let now = self.now;
        let n = self.node(id);
        n.tick += 1;
        let mut messages: Vec<local::GameMessage> = n.queued.drain(..).map(Into::into).collect();
        messages.push(game_message::Body::TickEnd(local::TickEnd { tick: n.tick }).into());
        n.core
            .handle(at(now), Input::GameFrame { conn: 1, messages });
        n.core.handle(at(now), Input::Timer);
    }

    /// Carries frames and store calls until both cores are quiet.
    pub fn carry(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..2 {
                let mut to_peer = Vec::new();
                let mut to_store = Vec::new();
                while let Some(out) = self.nodes[i].core.poll_output() {
                    match out {
                        Output::ToLink { frame, .. } => to_peer.push(frame),
                        Output::ToGame { frame, .. } => self.nodes[i].play(self.now, frame),
                        Output::Store(r) => to_store.push(r),
                        Output::GameFatal { .. }
                        | Output::KillGame { .. }
                        | Output::ReleaseGame { .. } => self.nodes[i].game_cut = true,
                        _ => {}
                    }
                }
                for frame in to_peer {
                    moved = true;
                    self.nodes[1 - i].core.handle(
                        at(self.now),
                        Input::LinkFrame {
                            link: LINK,
                            messages: frame.messages,
                        },
                    );
                }
                for request in to_store {
                    self.nodes[i].store_asked.push(request.clone());
                    if let Some(slow) = &mut self.store_slow {
                        slow.push((i, request));
                        continue;
                    }
                    if let Some(reply) = self.run_store(i, request) {
                        moved = true;
                        self.nodes[i].core.handle(at(self.now), Input::Store(reply));
                    }
                }
            }
            if !moved {
                break;
            }
        }
    }

    /// From now on, store calls wait for [`Pair::answer_store`].
    pub fn slow_store(&mut self) {
        self.store_slow.get_or_insert_with(Vec::new);
    }

    /// Runs the calls the slow store kept, in order, hands each node its answers, and carries
    /// what follows; the store answers at once again.
    pub fn answer_store(&mut self) {
        for (i, request) in self.store_slow.take().unwrap_or_default() {
            if let Some(reply) = self.run_store(i, request) {
                self.nodes[i].core.handle(at(self.now), Input::Store(reply));
            }
        }
        self.carry();
    }

    /// Runs node index `i`'s claim call as the sidecar's store driver does, on its geo's store,
    /// at the harness's time. Other store calls go unanswered.
    fn run_store(&mut self, i: usize, request: StoreRequest) -> Option<StoreReply> {
        let up = !self.store_down;
        let store = match (&mut self.second_store, i) {
            (Some(second), 1) => second,
            _ => &mut self.store,
        };
        super::claims::claim_call_on_table(store, self.now, request, up)
    }

    /// Who holds `key` in the store now (looked at without touching the store).
    pub fn store_holder(&self, key: &str) -> Option<ClaimHolder> {
        self.store_holder_at(self.now, key)
    }

    /// Who holds `key` in the store at `ms`, if nothing else happens meanwhile.
    pub fn store_holder_at(&self, ms: u64, key: &str) -> Option<ClaimHolder> {
        self.store.clone().holder(ms, key)
    }

    pub fn steps(&mut self, n: usize) {
        for _ in 0..n {
            self.step();
        }
    }

    /// Node `id`'s game spawns NPC `entity` at (x, 40).
    pub fn spawn(&mut self, id: NodeId, entity: u64, x: f64) {
        self.game_sends(
            id,
            game_message::Body::Spawn(local::Spawn {
                entity_id: entity,
                position: pos(x, 40.0),
                ..Default::default()
            }),
        );
    }

    pub fn move_to(&mut self, id: NodeId, entity: u64, x: f64) {
        self.game_sends(
            id,
            game_message::Body::Update(local::Update {
                entity_id: entity,
                position: pos(x, 40.0),
                ..Default::default()
            }),
        );
    }

    pub fn command(&mut self, from: NodeId, target: u64, request_id: u64, r#type: u32) {
        self.game_sends(
            from,
            game_message::Body::Command(local::Command {
                target_entity: target,
                r#type,
                payload: Bytes::from_static(b"hit"),
                request_id,
                from_entity: 0,
            }),
        );
    }

    /// Node `id`'s game claims `key` for `holder`.
    pub fn claim(&mut self, id: NodeId, key: &str, holder: u64, ttl_ms: u32, request_id: u64) {
        self.game_sends(
            id,
            game_message::Body::Claim(local::Claim {
                key: key.into(),
                holder_entity: holder,
                ttl_ms,
                request_id,
            }),
        );
    }

    /// Node `id`'s game releases `key` (whichever of its entities holds it).
    pub fn release_claim(&mut self, id: NodeId, key: &str) {
        self.game_sends(
            id,
            game_message::Body::ClaimRelease(local::ClaimRelease {
                key: key.into(),
                ..Default::default()
            }),
        );
    }
}
