//! Handoff between nodes over real sockets (docs/mesh.md#handoff): in-process sidecars on loopback, games
//! scripted by the test through the local protocol (so the test decides when `Snapshot` and
//! `Adopted` go), clients logged in through real proxies, a relay that can hold, cut and replay the link between
//! two nodes, and peer sidecars played by the test over raw mesh links.
//!
//! The world is 16 × 16 chunks. With two nodes side by side, node 1 owns chunk columns 0-7 and
//! node 2 columns 8-15; an entity walks from column 7 (next to the border) to column 9 (two
//! chunks past it: beyond the default handoff margin of one chunk).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cellmesh_proto::edge::{self, DeltaKind};
use cellmesh_proto::local::{self, game_message, sidecar_message, AudienceKind};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame};
use cellmesh_sidecar::{Real, SidecarConfig, SidecarHandle, SidecarStats};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::{
    Acquire, Commit, DirectorAcquire, DirectorLease, Lease, NodeEntry, NodeRecord, TopologyError,
    TopologyStore,
};
use cellmesh_stores::Stores;
use cellmesh_test_support::{unix_ms, PATIENCE};
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, Partition};
use futures::{SinkExt, StreamExt};
use prost::Message;
use support::*;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use sidecar_message::Body as ToGame;

const KIND: u32 = 1;
const HEALTH: u32 = 2;
const INVENTORY: u32 = 3;
/// What the scripted games put in a snapshot.
const STATE: &[u8] = b"complete state of alice";
/// How long each polling round listens before the games tick again.
const POLL: Duration = Duration::from_millis(15);
const RETRY_MS: u64 = 1_000;

fn world() -> WorldShape {
    WorldShape {
        width: 16.0 * CHUNK,
        height: 16.0 * CHUNK,
        chunk_size: CHUNK,
        region_size: 8.0 * CHUNK,
    }
}

fn config(node_id: u32) -> SidecarConfig {
    SidecarConfig {
        node_id,
        world: world(),
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        attest_keys: vec![attest_key()],
        ghost_min_lifespan_ms: 300,
        handoff_retry_ms: RETRY_MS,
        // These games answer `Freeze`: the path of games of protocol 1.7 and older, and of any
        // game that leaves an `Offload` unanswered (the scripted tests in the crate cover it).
        handoff_offload: false,
        // Nodes of parallel tests share this process and their ids: none locks a state dir.
        state_dir: String::new(),
        ..SidecarConfig::default()
    }
}

/// A deadline for a polling loop: `check` panics naming what never happened. [`PATIENCE`] covers
/// waits across a cut link too: the dialling node redials with a back-off of up to 2 s.
struct Patience {
    until: Instant,
    what: String,
}

impl Patience {
    fn new(what: impl Into<String>) -> Self {
        Self {
            until: Instant::now() + PATIENCE,
            what: what.into(),
        }
    }

    fn check(&self) {
        assert!(
            Instant::now() < self.until,
            "timed out waiting for {}",
            self.what
        );
    }
}

// ---------------------------------------------------------------------------- the cluster

struct TestNode {
    handle: Option<SidecarHandle>,
    stop: CancellationToken,
    game: Option<TestGame>,
    ids: Vec<u64>,
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The topology store as one node sees it: silent (every call pending, as a store that stalls
/// or a network that partitions it from that node) while `cut` is set.
struct NodeView {
    store: Arc<dyn TopologyStore>,
    cut: Arc<AtomicBool>,
}

impl NodeView {
    async fn call<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        if self.cut.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        f.await
    }
}

#[async_trait::async_trait]
impl TopologyStore for NodeView {
    async fn partition(&self) -> Result<Option<Partition>, TopologyError> {
        self.call(self.store.partition()).await
    }
    async fn commit_partition(
        &self,
        expected: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        self.call(self.store.commit_partition(expected, next)).await
    }
    async fn acquire_lease(
        &self,
        node: u32,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        self.call(self.store.acquire_lease(node, holder, ttl)).await
    }
    async fn take_over_lease(
        &self,
        previous: &Lease,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        self.call(self.store.take_over_lease(previous, holder, ttl))
            .await
    }
    async fn renew_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        self.call(self.store.renew_lease(lease, ttl)).await
    }
    async fn reclaim_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        self.call(self.store.reclaim_lease(lease, ttl)).await
    }
    async fn release_lease(&self, lease: &Lease) -> Result<bool, TopologyError> {
        self.call(self.store.release_lease(lease)).await
    }
    async fn publish_node(
        &self,
        lease: &Lease,
        record: &NodeRecord,
    ) -> Result<bool, TopologyError> {
        self.call(self.store.publish_node(lease, record)).await
    }
    async fn nodes(&self) -> Result<Vec<NodeEntry>, TopologyError> {
        self.call(self.store.nodes()).await
    }
    async fn mark_restored(&self, node: u32, lease_epoch: u64) -> Result<(), TopologyError> {
        self.call(self.store.mark_restored(node, lease_epoch)).await
    }
    async fn restored_among(
        &self,
        processes: &[(u32, u64)],
    ) -> Result<Vec<(u32, u64)>, TopologyError> {
        self.call(self.store.restored_among(processes)).await
    }
    async fn publish_load(
        &self,
        lease: &Lease,
        report: &cellmesh_world::balance::CellReport,
    ) -> Result<bool, TopologyError> {
        self.call(self.store.publish_load(lease, report)).await
    }
    async fn loads(
        &self,
    ) -> Result<BTreeMap<u32, cellmesh_world::balance::CellReport>, TopologyError> {
        self.call(self.store.loads()).await
    }
    async fn publish_players(
        &self,
        lease: &Lease,
        players: &[cellmesh_stores::topology::PlayerSample],
    ) -> Result<bool, TopologyError> {
        self.call(self.store.publish_players(lease, players)).await
    }
    async fn players(
        &self,
    ) -> Result<BTreeMap<u32, Vec<cellmesh_stores::topology::PlayerSample>>, TopologyError> {
        self.call(self.store.players()).await
    }
    async fn acquire_director(
        &self,
        holder: &str,
        ttl: Duration,
    ) -> Result<DirectorAcquire, TopologyError> {
        self.call(self.store.acquire_director(holder, ttl)).await
    }
    async fn renew_director(
        &self,
        lease: &DirectorLease,
        ttl: Duration,
    ) -> Result<Option<DirectorLease>, TopologyError> {
        self.call(self.store.renew_director(lease, ttl)).await
    }
    async fn release_director(&self, lease: &DirectorLease) -> Result<bool, TopologyError> {
        self.call(self.store.release_director(lease)).await
    }
    async fn commit_partition_as(
        &self,
        director: &DirectorLease,
        expected: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        self.call(self.store.commit_partition_as(director, expected, next))
            .await
    }
}

/// Nodes started in this process under one committed partition; each may have a scripted game.
struct Cluster {
    topology: Arc<dyn TopologyStore>,
    /// Per node: set to cut it off from the topology store.
    store_cut: BTreeMap<u32, Arc<AtomicBool>>,
    /// How far the topology store's clock runs ahead of this machine's (ms).
    store_ahead_ms: Arc<AtomicU64>,
    stores: Stores,
    nodes: BTreeMap<u32, TestNode>,
    tick: u64,
}

impl Cluster {
    /// Commits a `cols × rows` grid whose regions belong to `table` (row by row) as epoch 1.
    async fn plan(cols: u32, rows: u32, table: Vec<u32>) -> Self {
        let grid = Grid::new(&world(), cols, rows, table).unwrap();
        let partition = Partition::new(world(), 1, Layout::Grid(grid)).unwrap();
        let store_ahead_ms = Arc::new(AtomicU64::new(0));
        let ahead = store_ahead_ms.clone();
        let topology: Arc<dyn TopologyStore> =
            Arc::new(MemoryTopology::with_clock(Arc::new(move || {
                unix_ms() + ahead.load(Ordering::SeqCst)
            })));
        topology.commit_partition(0, &partition).await.unwrap();
        Self {
            topology,
            store_cut: BTreeMap::new(),
            store_ahead_ms,
            stores: Stores::in_memory(),
            nodes: BTreeMap::new(),
            tick: 0,
        }
    }

    async fn start(&mut self, cfg: SidecarConfig, with_game: bool) {
        let id = cfg.node_id;
        let stop = CancellationToken::new();
        let cut = self.store_cut.entry(id).or_default().clone();
        let view = Arc::new(NodeView {
            store: self.topology.clone(),
            cut,
        });
        let handle = cellmesh_sidecar::start_in(cfg, self.stores.clone(), view, stop.clone())
            .await
            .expect("node starts");
        self.nodes.insert(
            id,
            TestNode {
                handle: Some(handle),
                stop,
                game: None,
                ids: Vec::new(),
            },
        );
        if with_game {
            self.connect_game(id).await;
        }
    }

    async fn connect_game(&mut self, id: u32) {
        let n = self.nodes.get_mut(&id).expect("a node of this cluster");
        let mut game = TestGame::connect(&n.handle.as_ref().unwrap().local_addr).await;
        n.ids = game.reserve(64).await;
        n.game = Some(game);
    }

    /// Closes the node's game connection.
    async fn drop_game(&mut self, id: u32) {
        self.nodes.get_mut(&id).unwrap().game = None;
        self.stats_until(id, "the game to be gone", |s| !s.game_connected)
            .await;
    }

    fn h(&self, id: u32) -> &SidecarHandle {
        self.nodes[&id].handle.as_ref().expect("running")
    }

    fn game(&mut self, id: u32) -> &mut TestGame {
        self.nodes
            .get_mut(&id)
            .and_then(|n| n.game.as_mut())
            .expect("a node with a game")
    }

    fn id(&mut self, node: u32) -> u64 {
        self.nodes.get_mut(&node).unwrap().ids.pop().expect("ids")
    }

    /// Ends a tick on every game.
    async fn tick(&mut self) {
        self.tick += 1;
        let t = self.tick;
        for n in self.nodes.values_mut() {
            if let Some(g) = n.game.as_mut() {
                g.tick(t).await;
            }
        }
    }

    async fn stats_until(&self, id: u32, what: &str, f: impl Fn(&SidecarStats) -> bool) {
        let p = Patience::new(format!("node {id}: {what}"));
        while !f(&self.h(id).stats()) {
            p.check();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn peers_up(&self, id: u32, n: u64) {
        self.stats_until(id, &format!("{n} peer links up"), |s| s.peers_up == n)
            .await;
    }

    /// Waits until every node has a link up to every other.
    async fn linked(&self) {
        let n = self.nodes.len() as u64 - 1;
        for id in self.nodes.keys() {
            self.peers_up(*id, n).await;
        }
    }

    async fn state(&self, id: u32) -> serde_json::Value {
        let (status, body) = cellmesh_admin::http_get(self.h(id).admin_addr, "/state")
            .await
            .unwrap();
        assert_eq!(status, 200);
        serde_json::from_str(&body).unwrap()
    }

    async fn state_until(&self, id: u32, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
        let p = Patience::new(format!("node {id}: {what}"));
        while !f(&self.state(id).await) {
            p.check();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until node `id` stopped by itself for its lost lease (as its process exits).
    async fn exited_for_lost_lease(&self, id: u32) {
        let p = Patience::new(format!("node {id}: to stop for its lost lease"));
        while !self.nodes[&id].stop.is_cancelled() {
            p.check();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let why = self.h(id).failure().expect("a reason to exit");
        assert!(why.contains("the node lease was lost"), "{why}");
    }

    async fn ready(&self, id: u32) -> u16 {
        cellmesh_admin::http_get(self.h(id).admin_addr, "/ready")
            .await
            .unwrap()
            .0
    }

    /// Ticks every game until `node`'s game receives a message `f` accepts.
    async fn tick_until_game<T>(
        &mut self,
        node: u32,
        what: &str,
        mut f: impl FnMut(&ToGame) -> Option<T>,
    ) -> T {
        let p = Patience::new(format!("node {node}'s game: {what}"));
        loop {
            p.check();
            self.tick().await;
            if let Some(t) = self.game(node).expect_within(POLL, &mut f).await {
                return t;
            }
        }
    }

    /// Every real of `id` in the cluster, with its node (at most 100 ms old).
    fn census(&self, id: u64) -> Vec<(u32, Real)> {
        self.nodes
            .iter()
            .flat_map(|(n, node)| {
                node.handle
                    .as_ref()
                    .map(|h| h.reals())
                    .unwrap_or_default()
                    .into_iter()
                    .filter(move |r| r.id == id)
                    .map(move |r| (*n, r))
            })
            .collect()
    }

    async fn census_until(&self, id: u64, want: &[(u32, Real)]) {
        let p = Patience::new(format!("a census of {want:?}"));
        loop {
            let got = self.census(id);
            if got == want {
                return;
            }
            assert!(
                Instant::now() < p.until,
                "timed out waiting for a census of {want:?}; it shows {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn real(id: u64, epoch: u64, frozen: bool) -> Real {
    Real { id, epoch, frozen }
}

// ---------------------------------------------------------------------------- the games

/// A player's avatar with a public kind and an owner-only inventory.
fn player(id: u64, account: &str, at: local::Vec3) -> game_message::Body {
    game_message::Body::Spawn(local::Spawn {
        entity_id: id,
        position: Some(at),
        components: vec![
            comp(
                KIND,
                &format!("player:{account}"),
                aud(AudienceKind::PublicInRange, &[]),
            ),
            comp(INVENTORY, "sword", aud(AudienceKind::OwnerOnly, &[])),
        ],
        owner_account: account.into(),
        is_master: true,
        parent_id: 0,
    })
}

fn freeze_of(id: u64) -> impl FnMut(&ToGame) -> Option<u64> {
    move |m| match m {
        ToGame::Freeze(f) if f.entity_id == id => Some(f.entity_epoch),
        _ => None,
    }
}

fn thaw_of(id: u64) -> impl FnMut(&ToGame) -> Option<String> {
    move |m| match m {
        ToGame::Thaw(t) if t.entity_id == id => Some(t.reason.clone()),
        _ => None,
    }
}

fn evict_of(id: u64) -> impl FnMut(&ToGame) -> Option<()> {
    move |m| match m {
        ToGame::Evict(e) if e.entity_id == id => Some(()),
        _ => None,
    }
}

fn adopt_of(id: u64) -> impl FnMut(&ToGame) -> Option<local::Adopt> {
    move |m| match m {
        ToGame::Adopt(a) if a.entity_id == id => Some(a.clone()),
        _ => None,
    }
}

fn ghost_enter_of(id: u64) -> impl FnMut(&ToGame) -> Option<local::GhostEnter> {
    move |m| match m {
        ToGame::GhostEnter(g) if g.entity_id == id => Some(g.clone()),
        _ => None,
    }
}

fn ghost_update_of(id: u64) -> impl FnMut(&ToGame) -> Option<local::GhostUpdate> {
    move |m| match m {
        ToGame::GhostUpdate(g) if g.entity_id == id => Some(g.clone()),
        _ => None,
    }
}

fn input_of(account: &'static str) -> impl FnMut(&ToGame) -> Option<local::Input> {
    move |m| match m {
        ToGame::Input(i) if i.account == account => Some(i.clone()),
        _ => None,
    }
}

fn error_about(id: u64) -> impl FnMut(&ToGame) -> Option<local::Error> {
    move |m| match m {
        ToGame::Error(e) if e.entity_id == id => Some(e.clone()),
        _ => None,
    }
}

async fn snapshot(game: &mut TestGame, id: u64, epoch: u64) {
    game.push(game_message::Body::Snapshot(local::Snapshot {
        entity_id: id,
        entity_epoch: epoch,
        state: Bytes::from_static(STATE),
    }));
    game.flush().await;
}

async fn adopted(game: &mut TestGame, id: u64, epoch: u64) {
    game.push(game_message::Body::Adopted(local::Adopted {
        entity_id: id,
        entity_epoch: epoch,
    }));
    game.flush().await;
}

/// The game writes `id` and is not told off: an id reservation behind the write is the barrier
/// (the sidecar answers a game's messages in order).
async fn assert_writable(game: &mut TestGame, id: u64) {
    game.push(change(
        id,
        comp(
            HEALTH,
            "written after the thaw",
            aud(AudienceKind::PublicInRange, &[]),
        ),
    ));
    game.reserve(1).await;
    let refused = game.expect_within(Duration::ZERO, error_about(id)).await;
    assert!(
        refused.is_none(),
        "a write after the thaw was refused: {refused:?}"
    );
}

// ---------------------------------------------------------------------------- claims

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// Spawned, or adopted (`Adopted` sent), under this epoch: the game writes the entity.
    Start(u64),
    /// `Freeze` naming this epoch: the game stops writing.
    Freeze(u64),
    Thaw,
    /// `Evict`: the game lets the entity go.
    End,
}

/// Every claim on one entity as the scripted games saw them, checked as each is recorded: never
/// two unfrozen claims at once, epochs rising with no epoch claimed twice, and an eviction only
/// after another node claimed a later epoch.
#[derive(Default)]
struct Claims {
    log: Vec<(u32, Claim)>,
    /// node -> (epoch, frozen)
    holders: BTreeMap<u32, (u64, bool)>,
    /// epoch -> the node that claimed it
    epochs: BTreeMap<u64, u32>,
}

impl Claims {
    fn record(&mut self, node: u32, claim: Claim) {
        self.log.push((node, claim));
        let log = &self.log;
        match claim {
            Claim::Start(epoch) => {
                assert!(
                    !self.holders.contains_key(&node),
                    "node {node} claimed twice: {log:?}"
                );
                assert!(
                    self.epochs.keys().all(|e| *e < epoch),
                    "epoch {epoch} is not above every earlier claim: {log:?}"
                );
                self.epochs.insert(epoch, node);
                self.holders.insert(node, (epoch, false));
            }
            Claim::Freeze(epoch) => {
                let h = self.holders.get_mut(&node).unwrap_or_else(|| {
                    panic!("Freeze on node {node}, which has no claim: {log:?}")
                });
                assert_eq!(h.0, epoch, "Freeze names another epoch: {log:?}");
                h.1 = true;
            }
            Claim::Thaw => {
                let h = self
                    .holders
                    .get_mut(&node)
                    .unwrap_or_else(|| panic!("Thaw on node {node}, which has no claim: {log:?}"));
                assert!(h.1, "Thaw of a claim that was not frozen: {log:?}");
                h.1 = false;
            }
            Claim::End => {
                let (epoch, frozen) = self
                    .holders
                    .remove(&node)
                    .unwrap_or_else(|| panic!("Evict on node {node}, which has no claim: {log:?}"));
                assert!(frozen, "evicted without a freeze: {log:?}");
                assert!(
                    self.epochs.range(epoch + 1..).any(|(_, n)| *n != node),
                    "node {node} evicted before another node adopted: {log:?}"
                );
            }
        }
        let writers = self.holders.values().filter(|(_, frozen)| !frozen).count();
        assert!(writers <= 1, "two unfrozen claims at once: {:?}", self.log);
    }

    fn holds(&self, node: u32) -> bool {
        self.holders.contains_key(&node)
    }

    fn frozen(&self, node: u32) -> bool {
        self.holders.get(&node).is_some_and(|h| h.1)
    }

    /// The census the claims call for once one claim is left: its node and real.
    fn expected(&self, id: u64) -> Vec<(u32, Real)> {
        self.holders
            .iter()
            .map(|(n, (epoch, frozen))| (*n, real(id, *epoch, *frozen)))
            .collect()
    }
}

/// Reads what `node`'s game was told about `x`, records the claims, and answers like a game
/// honouring the contract: `Freeze` with a complete `Snapshot`, `Adopt` with `Adopted`.
async fn play(c: &mut Cluster, node: u32, x: u64, claims: &mut Claims) {
    let Some(game) = c.nodes.get_mut(&node).and_then(|n| n.game.as_mut()) else {
        return;
    };
    for m in game.drain(POLL).await {
        match m {
            ToGame::Freeze(f) if f.entity_id == x => {
                claims.record(node, Claim::Freeze(f.entity_epoch));
                snapshot(game, x, f.entity_epoch).await;
            }
            ToGame::Thaw(t) if t.entity_id == x => claims.record(node, Claim::Thaw),
            ToGame::Evict(e) if e.entity_id == x => claims.record(node, Claim::End),
            ToGame::Adopt(a) if a.entity_id == x => {
                assert_eq!(
                    a.state,
                    Bytes::from_static(STATE),
                    "the snapshot, unchanged"
                );
                claims.record(node, Claim::Start(a.entity_epoch));
                adopted(game, x, a.entity_epoch).await;
            }
            _ => {}
        }
    }
}

/// Plays both games of a pair until node 1 let go of `x` and the census agrees with the claims,
/// then a while longer, in which nothing more may happen to it.
async fn finish(c: &mut Cluster, claims: &mut Claims, x: u64) {
    let p = Patience::new("the handoff to complete");
    loop {
        p.check();
        c.tick().await;
        play(c, 1, x, claims).await;
        play(c, 2, x, claims).await;
        if !claims.holds(1) && c.census(x) == claims.expected(x) {
            break;
        }
    }
    for _ in 0..10 {
        c.tick().await;
        play(c, 1, x, claims).await;
        play(c, 2, x, claims).await;
    }
    let want = claims.expected(x);
    assert_eq!(want.len(), 1, "one claim left: {:?}", claims.log);
    assert!(!want[0].1.frozen, "the last claim writes: {:?}", claims.log);
    c.census_until(x, &want).await;
}

/// Node 1's game spawns `x`, alice's avatar, next to node 2's area; if `perceived`, waits until
/// node 2 holds it as a ghost (its game perceives it across the border).
async fn spawn_near_border(c: &mut Cluster, claims: &mut Claims, perceived: bool) -> u64 {
    let x = c.id(1);
    c.game(1).push(player(x, "alice", chunk(7, 4)));
    claims.record(1, Claim::Start(1));
    if perceived {
        c.tick_until_game(2, "a ghost of X", ghost_enter_of(x))
            .await;
    } else {
        c.tick().await;
    }
    x
}

/// Walks `x` two chunks into node 2's area; node 1's game is told to freeze it.
async fn cross(c: &mut Cluster, claims: &mut Claims, x: u64) {
    c.game(1).push(move_to(x, chunk(9, 4)));
    // At once if the target holds X's ghost; a target that never subscribes (no game) is
    // offered X after a second all the same.
    let epoch = c.tick_until_game(1, "Freeze of X", freeze_of(x)).await;
    claims.record(1, Claim::Freeze(epoch));
}

// ---------------------------------------------------------------------------- clients

/// A client logged in through a real proxy, keeping every delta it got about one entity.
struct Watcher {
    proxy: Edge,
    player: u64,
    of: u64,
    deltas: Vec<edge::EntityDelta>,
}

impl Watcher {
    async fn poll(&mut self) {
        for b in self.proxy.batches_within(self.player, POLL).await {
            let of = self.of;
            self.deltas
                .extend(b.deltas.into_iter().filter(|d| d.entity_id == of));
        }
    }

    fn count(&self, kind: DeltaKind) -> usize {
        self.deltas.iter().filter(|d| d.kind() == kind).count()
    }

    fn saw(&self, f: impl Fn(&edge::EntityDelta) -> bool) -> bool {
        self.deltas.iter().any(f)
    }
}

fn payload_of(d: &edge::EntityDelta, t: u32) -> Option<&[u8]> {
    d.components
        .iter()
        .find(|c| c.r#type == t)
        .map(|c| c.payload.as_ref())
}

fn at(d: &edge::EntityDelta, want: local::Vec3) -> bool {
    d.position.is_some_and(|p| (p.x, p.y) == (want.x, want.y))
}

// ---------------------------------------------------------------------------- a relay

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// From the dialling node to the node behind the relay.
    Up = 0,
    Down = 1,
}

/// A TCP relay in front of a node's mesh listener (peers dial it through `mesh_advertise`). It
/// passes whole frames, so it can record what went each way, hold one direction, cut every
/// connection, refuse new ones, and inject a frame towards the node behind it.
struct Relay {
    addr: SocketAddr,
    inner: Arc<RelayInner>,
}

struct RelayInner {
    target: Mutex<Option<SocketAddr>>,
    open: AtomicBool,
    cut: Mutex<CancellationToken>,
    hold: [watch::Sender<bool>; 2],
    seen: Mutex<Vec<(Dir, mesh_message::Body)>>,
    inject: Mutex<Option<mpsc::UnboundedSender<Bytes>>>,
}

impl RelayInner {
    fn record(&self, dir: Dir, frame: &Bytes) {
        let Ok(f) = MeshFrame::decode(frame.clone()) else {
            return;
        };
        let mut seen = self.seen.lock().unwrap();
        for m in f.messages {
            match m.body {
                Some(mesh_message::Body::Heartbeat(_)) | None => {}
                Some(b) => seen.push((dir, b)),
            }
        }
    }
}

impl Relay {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let inner = Arc::new(RelayInner {
            target: Mutex::new(None),
            open: AtomicBool::new(true),
            cut: Mutex::new(CancellationToken::new()),
            hold: [watch::channel(false).0, watch::channel(false).0],
            seen: Mutex::default(),
            inject: Mutex::new(None),
        });
        let relay = Self {
            addr: listener.local_addr().unwrap(),
            inner: inner.clone(),
        };
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let target = *inner.target.lock().unwrap();
                let Some(target) = target.filter(|_| inner.open.load(Ordering::SeqCst)) else {
                    continue; // dropped: the dialler sees the connection close
                };
                let conn = inner.cut.lock().unwrap().child_token();
                let inner = inner.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                    let (in_r, in_w) = inbound.into_split();
                    let (out_r, out_w) = outbound.into_split();
                    let (inject, injected) = mpsc::unbounded_channel();
                    *inner.inject.lock().unwrap() = Some(inject);
                    let (_none, nothing) = mpsc::unbounded_channel();
                    tokio::join!(
                        pass(Dir::Up, in_r, out_w, injected, inner.clone(), conn.clone()),
                        pass(Dir::Down, out_r, in_w, nothing, inner.clone(), conn.clone()),
                    );
                });
            }
        });
        relay
    }

    fn set_target(&self, to: SocketAddr) {
        *self.inner.target.lock().unwrap() = Some(to);
    }

    /// Severs every connection (what is held is lost) and refuses new ones until `restore`.
    fn cut(&self) {
        self.inner.open.store(false, Ordering::SeqCst);
        let mut c = self.inner.cut.lock().unwrap();
        c.cancel();
        *c = CancellationToken::new();
    }

    fn restore(&self) {
        for h in &self.inner.hold {
            h.send_replace(false);
        }
        self.inner.open.store(true, Ordering::SeqCst);
    }

    /// Frames going `dir` are read but not passed on.
    fn hold(&self, dir: Dir) {
        self.inner.hold[dir as usize].send_replace(true);
    }

    fn seen<T>(&self, dir: Dir, mut f: impl FnMut(&mesh_message::Body) -> Option<T>) -> Vec<T> {
        self.inner
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(d, _)| *d == dir)
            .filter_map(|(_, b)| f(b))
            .collect()
    }

    async fn seen_until<T>(
        &self,
        dir: Dir,
        what: &str,
        mut f: impl FnMut(&mesh_message::Body) -> Option<T>,
    ) -> T {
        let p = Patience::new(format!("the relay to see {what}"));
        loop {
            if let Some(t) = self.seen(dir, &mut f).pop() {
                return t;
            }
            p.check();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends `body` towards the node behind the relay, between two frames of the dialler's.
    fn inject(&self, body: mesh_message::Body) {
        let frame = Bytes::from(MeshFrame::one(body).encode_to_vec());
        self.inner
            .inject
            .lock()
            .unwrap()
            .as_ref()
            .expect("a connection through the relay")
            .send(frame)
            .expect("the connection is up");
    }
}

/// One direction of a relayed connection, frame by frame.
async fn pass(
    dir: Dir,
    from: OwnedReadHalf,
    to: OwnedWriteHalf,
    mut injected: mpsc::UnboundedReceiver<Bytes>,
    relay: Arc<RelayInner>,
    conn: CancellationToken,
) {
    let mut reader = FramedRead::new(from, LengthDelimitedCodec::new());
    let mut writer = FramedWrite::new(to, LengthDelimitedCodec::new());
    let mut hold = relay.hold[dir as usize].subscribe();
    loop {
        let frame = tokio::select! {
            _ = conn.cancelled() => break,
            Some(f) = injected.recv() => f,
            f = reader.next() => match f {
                Some(Ok(f)) => {
                    let f = f.freeze();
                    relay.record(dir, &f);
                    f
                }
                _ => break,
            },
        };
        // A held frame waits here, and the socket behind it, until released or cut.
        let released = async {
            while *hold.borrow_and_update() {
                if hold.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            _ = conn.cancelled() => break,
            _ = released => {}
        }
        let sent = tokio::select! {
            _ = conn.cancelled() => break,
            r = writer.send(frame) => r,
        };
        if sent.is_err() {
            break;
        }
    }
    conn.cancel();
}

/// Two nodes side by side, each with a game; node 1 reaches node 2 only through the relay.
async fn pair_via_relay() -> (Cluster, Relay) {
    let relay = Relay::start().await;
    let mut c = Cluster::plan(2, 1, vec![1, 2]).await;
    c.start(config(1), true).await;
    let mut cfg = config(2);
    cfg.mesh_advertise = relay.addr.to_string();
    c.start(cfg, true).await;
    relay.set_target(c.h(2).mesh_addr);
    c.linked().await;
    (c, relay)
}

fn offer_of(id: u64) -> impl FnMut(&mesh_message::Body) -> Option<mesh::HandoffOffer> {
    move |m| match m {
        mesh_message::Body::HandoffOffer(o) if o.entity_id == id => Some(o.clone()),
        _ => None,
    }
}

fn ack_of(id: u64) -> impl FnMut(&mesh_message::Body) -> Option<u64> {
    move |m| match m {
        mesh_message::Body::HandoffAck(a) if a.entity_id == id => Some(a.entity_epoch),
        _ => None,
    }
}

fn refusal_of(id: u64) -> impl FnMut(&mesh_message::Body) -> Option<(u64, String)> {
    move |m| match m {
        mesh_message::Body::HandoffRefused(r) if r.entity_id == id => {
            Some((r.entity_epoch, r.reason.clone()))
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------- a clean handoff

#[tokio::test]
async fn a_player_crosses_the_border_with_nothing_lost_doubled_or_seen() {
    // Node 1 owns the top-left quarter, node 2 the top-right, node 3 the bottom half: node 3
    // watches the crossing from the side.
    let mut c = Cluster::plan(2, 2, vec![1, 2, 3, 3]).await;
    for id in 1..=3 {
        c.start(config(id), true).await;
    }
    c.linked().await;

    // Alice's gateway is node 1, whose game spawns her avatar X next to node 2's area.
    let mut alice_proxy = Edge::start("edge-1", &[c.h(1).mesh_addr]).await;
    let session = alice_proxy.login(1, "alice").await.session_epoch;
    c.game(1).expect_join("alice").await;
    let mut claims = Claims::default();
    let x = spawn_near_border(&mut c, &mut claims, false).await;
    // Bob's gateway and avatar are on node 3, with X in his view.
    let mut bob_proxy = Edge::start("edge-3", &[c.h(3).mesh_addr]).await;
    bob_proxy.login(1, "bob").await;
    c.game(3).expect_join("bob").await;
    let b = c.id(3);
    c.game(3).push(avatar(b, "bob", chunk(6, 9), vec![]));
    let mut alice = Watcher {
        proxy: alice_proxy,
        player: 1,
        of: x,
        deltas: Vec::new(),
    };
    let mut bob = Watcher {
        proxy: bob_proxy,
        player: 1,
        of: x,
        deltas: Vec::new(),
    };
    c.tick_until_game(2, "a ghost of X", ghost_enter_of(x))
        .await;
    let p = Patience::new("both clients to see X");
    while alice.count(DeltaKind::Appear) == 0 || bob.count(DeltaKind::Appear) == 0 {
        p.check();
        c.tick().await;
        alice.poll().await;
        bob.poll().await;
    }

    cross(&mut c, &mut claims, x).await;
    assert_eq!(
        claims.log[1],
        (1, Claim::Freeze(1)),
        "every entity starts at epoch 1"
    );
    // Alice's input while X is frozen and not yet offered: node 1 holds it. (Node 1 counting
    // the three is the barrier before the snapshot.)
    for seq in 1..=3 {
        alice.proxy.input(1, seq, b"walk").await;
    }
    c.stats_until(1, "alice's three inputs handled", |s| {
        s.inputs_from_proxies >= 3
    })
    .await;
    snapshot(c.game(1), x, 1).await;
    let adopt = c.game(2).expect("Adopt of X", adopt_of(x)).await;
    assert_eq!(adopt.entity_epoch, 2);
    assert_eq!(adopt.state, Bytes::from_static(STATE));
    assert_eq!(adopt.position, Some(chunk(9, 4)));
    assert_eq!(
        (adopt.owner_account.as_str(), adopt.is_master),
        ("alice", true)
    );
    // Input after the offer left: forwarded to node 2, held there until its game adopts.
    for seq in 4..=6 {
        alice.proxy.input(1, seq, b"walk").await;
    }
    c.state_until(2, "the six inputs held", |s| {
        s["held_frames"].as_u64() >= Some(6)
    })
    .await;
    let early = c
        .game(2)
        .expect_within(Duration::from_millis(50), input_of("alice"))
        .await;
    assert!(early.is_none(), "an input before Adopted: {early:?}");
    adopted(c.game(2), x, 2).await;
    claims.record(2, Claim::Start(2));
    c.game(1).expect("Evict of X", evict_of(x)).await;
    claims.record(1, Claim::End);
    for seq in 7..=9 {
        alice.proxy.input(1, seq, b"walk").await;
    }
    let mut seqs = Vec::new();
    while seqs.last() != Some(&9) {
        let i = c.game(2).expect("alice's inputs", input_of("alice")).await;
        assert_eq!(i.session_epoch, session);
        seqs.push(i.seq);
    }
    assert_eq!(seqs, (1..=9).collect::<Vec<_>>(), "in order, exactly once");
    c.census_until(x, &[(2, real(x, 2, false))]).await;
    assert_eq!(c.h(1).stats().handoffs, 1);

    // Node 2's game writes X: bob sees the move, alice her inventory (owner-only: node 2 routes
    // it to her gateway).
    c.game(2).push(game_message::Body::Update(local::Update {
        entity_id: x,
        position: Some(chunk(10, 4)),
        changed: vec![comp(
            INVENTORY,
            "sword,shield",
            aud(AudienceKind::OwnerOnly, &[]),
        )],
        removed_types: vec![],
    }));
    let p = Patience::new("node 2's writes to reach both clients");
    loop {
        p.check();
        c.tick().await;
        alice.poll().await;
        bob.poll().await;
        let moved = bob.saw(|d| d.kind() == DeltaKind::Update && at(d, chunk(10, 4)));
        let stocked = alice.saw(|d| payload_of(d, INVENTORY) == Some(b"sword,shield".as_slice()));
        if moved && stocked {
            break;
        }
    }
    for _ in 0..5 {
        c.tick().await;
        alice.poll().await;
        bob.poll().await;
    }
    for (who, w) in [("alice", &alice), ("bob", &bob)] {
        assert_eq!(
            w.count(DeltaKind::Vanish),
            0,
            "{who} saw X vanish: {:?}",
            w.deltas
        );
        assert_eq!(
            w.count(DeltaKind::Appear),
            1,
            "{who} saw X appear again: {:?}",
            w.deltas
        );
    }
    assert!(
        !alice.saw(|d| d.removed_types.contains(&INVENTORY)),
        "alice's inventory was removed: {:?}",
        alice.deltas
    );
    assert!(
        !bob.saw(|d| payload_of(d, INVENTORY).is_some()),
        "bob got alice's inventory: {:?}",
        bob.deltas
    );

    // Nothing more for the games: no input ever reached node 1's game after the freeze, no
    // thaw, no second adopt.
    for node in [1, 2] {
        for m in c.game(node).drain(Duration::from_millis(100)).await {
            match m {
                ToGame::Input(i) if node == 1 => panic!("node 1's game got {i:?}"),
                ToGame::Input(i) => panic!("a repeated input: {i:?}"),
                ToGame::Thaw(_) | ToGame::Evict(_) | ToGame::Adopt(_) | ToGame::Freeze(_) => {
                    panic!("node {node}'s game got {m:?}")
                }
                _ => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------- refusals

/// The target refuses (no game, or draining): the source's game thaws the entity, may write it
/// again, and it is not offered again before `handoff_retry_ms`.
async fn refused(draining: bool) {
    let mut c = Cluster::plan(2, 1, vec![1, 2]).await;
    c.start(config(1), true).await;
    c.start(config(2), draining).await;
    c.linked().await;
    if draining {
        // Node 2's game keeps something in node 1's area frozen, never answering the Freeze,
        // so the draining node stays up to answer.
        let y = c.id(2);
        c.game(2).push(npc(y, chunk(3, 4)));
        c.tick_until_game(2, "Freeze of Y", freeze_of(y)).await;
        c.h(2).drain();
        c.state_until(2, "draining", |s| s["draining"] == true)
            .await;
        assert_eq!(c.ready(2).await, 503);
    }
    let mut claims = Claims::default();
    let x = spawn_near_border(&mut c, &mut claims, false).await;
    cross(&mut c, &mut claims, x).await;
    let offered = Instant::now();
    snapshot(c.game(1), x, 1).await;
    let reason = c.game(1).expect("Thaw of X", thaw_of(x)).await;
    claims.record(1, Claim::Thaw);
    let want = if draining {
        "the target is draining"
    } else {
        "the target has no game connected"
    };
    assert_eq!(reason, want);
    assert_writable(c.game(1), x).await;
    c.census_until(x, &[(1, real(x, 1, false))]).await;
    let s = c.h(1).stats();
    assert_eq!((s.handoffs_refused, s.handoffs, s.in_doubt_now), (1, 0, 0));

    // X still stands in node 2's area: it is offered again, once the retry time is up.
    let epoch = c
        .tick_until_game(1, "the second Freeze of X", freeze_of(x))
        .await;
    claims.record(1, Claim::Freeze(epoch));
    let waited = offered.elapsed();
    // (The node counts whole milliseconds.)
    assert!(
        waited + Duration::from_millis(2) >= Duration::from_millis(RETRY_MS),
        "offered again after {waited:?}"
    );
    assert_eq!(epoch, 1, "nothing was adopted: the epoch is unchanged");
}

/// Every node publishes its load report under its lease, once a second on its game's tick, for
/// the director: the topology store lists it with the epoch the node applied.
#[tokio::test]
async fn each_node_publishes_its_load_report_for_the_balancer() {
    let mut c = Cluster::plan(2, 1, vec![1, 2]).await;
    for id in 1..=2 {
        c.start(config(id), true).await;
    }
    c.linked().await;
    let p = Patience::new("both nodes' load reports in the topology store");
    loop {
        c.tick().await;
        let loads = c.topology.loads().await.unwrap();
        if loads.len() == 2 {
            for (node, r) in &loads {
                assert_eq!(r.partition_epoch, 1, "node {node}: {r:?}");
                assert_eq!(r.ghost_chunks, 6, "view radius 5 + release margin 1");
                assert_eq!(r.rect.area(), 8 * 16, "its region, half the world: {r:?}");
                assert!((0.0..1.0).contains(&r.load), "node {node}: {r:?}");
            }
            break;
        }
        p.check();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_target_without_a_game_refuses_and_the_source_thaws() {
    refused(false).await;
}

#[tokio::test]
async fn a_draining_target_refuses_and_the_source_thaws() {
    refused(true).await;
}

// ---------------------------------------------------------------------------- fault injection

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The source's game holds its snapshot back; the link goes down; then the snapshot.
    BeforeOffer,
    /// The offer reached the target's game, which holds `Adopted` back until the link is back.
    AfterOffer,
    /// The target adopted; its ack reached the relay and went no further.
    AfterAdopt,
    /// The source evicted; then the link goes down.
    AfterAck,
}

/// Ticks a while with the link down: the unanswered offer stays in doubt, X stays frozen.
async fn stays_in_doubt(c: &mut Cluster, claims: &mut Claims, x: u64) {
    for _ in 0..15 {
        c.tick().await;
        play(c, 1, x, claims).await;
    }
    assert!(claims.frozen(1), "thawed while in doubt: {:?}", claims.log);
    assert_eq!(c.h(1).stats().in_doubt_now, 1);
    assert!(
        c.h(1).reals().contains(&real(x, 1, true)),
        "{:?}",
        c.h(1).reals()
    );
}

async fn cut_during_handoff(fault: Fault) {
    let (mut c, relay) = pair_via_relay().await;
    let mut claims = Claims::default();
    let x = spawn_near_border(&mut c, &mut claims, true).await;
    cross(&mut c, &mut claims, x).await;
    match fault {
        Fault::BeforeOffer => {
            relay.cut();
            c.peers_up(1, 0).await;
            snapshot(c.game(1), x, 1).await;
            // The offer never left: the entity may thaw.
            let reason = c.game(1).expect("Thaw of X", thaw_of(x)).await;
            claims.record(1, Claim::Thaw);
            assert_eq!(reason, "the target was unreachable");
            assert_writable(c.game(1), x).await;
            relay.restore();
        }
        Fault::AfterOffer => {
            snapshot(c.game(1), x, 1).await;
            let adopt = c.game(2).expect("Adopt of X", adopt_of(x)).await;
            relay.cut();
            c.peers_up(1, 0).await;
            c.peers_up(2, 0).await;
            stays_in_doubt(&mut c, &mut claims, x).await;
            relay.restore();
            // The offer is repeated on the new link; node 2 is still adopting it.
            c.linked().await;
            adopted(c.game(2), x, adopt.entity_epoch).await;
            claims.record(2, Claim::Start(adopt.entity_epoch));
        }
        Fault::AfterAdopt => {
            snapshot(c.game(1), x, 1).await;
            let adopt = c.game(2).expect("Adopt of X", adopt_of(x)).await;
            relay.hold(Dir::Down);
            adopted(c.game(2), x, adopt.entity_epoch).await;
            claims.record(2, Claim::Start(adopt.entity_epoch));
            relay
                .seen_until(Dir::Down, "node 2's HandoffAck", ack_of(x))
                .await;
            relay.cut();
            c.peers_up(1, 0).await;
            stays_in_doubt(&mut c, &mut claims, x).await;
            relay.restore();
        }
        Fault::AfterAck => {
            snapshot(c.game(1), x, 1).await;
            let adopt = c.game(2).expect("Adopt of X", adopt_of(x)).await;
            adopted(c.game(2), x, adopt.entity_epoch).await;
            claims.record(2, Claim::Start(adopt.entity_epoch));
            c.game(1).expect("Evict of X", evict_of(x)).await;
            claims.record(1, Claim::End);
            relay.cut();
            c.peers_up(1, 0).await;
            relay.restore();
        }
    }
    c.linked().await;
    finish(&mut c, &mut claims, x).await;
    assert_eq!(
        claims.expected(x),
        [(2, real(x, 2, false))],
        "{:?}",
        claims.log
    );
    let evictions = claims.log.iter().filter(|c| c.1 == Claim::End).count();
    assert_eq!(evictions, 1, "{:?}", claims.log);
}

#[tokio::test]
async fn a_link_cut_before_the_offer_leaves_x_once() {
    cut_during_handoff(Fault::BeforeOffer).await;
}

#[tokio::test]
async fn a_link_cut_after_the_offer_leaves_x_once() {
    cut_during_handoff(Fault::AfterOffer).await;
}

#[tokio::test]
async fn a_link_cut_after_the_adopt_leaves_x_once() {
    cut_during_handoff(Fault::AfterAdopt).await;
}

#[tokio::test]
async fn a_link_cut_after_the_ack_leaves_x_once() {
    cut_during_handoff(Fault::AfterAck).await;
}

// ---------------------------------------------------------------------------- replay

/// Replays `offer` into node 2; returns once node 2 answered it or dropped it as stale.
async fn replay(c: &Cluster, relay: &Relay, offer: &mesh::HandoffOffer) {
    let x = offer.entity_id;
    let answers = |relay: &Relay| {
        relay.seen(Dir::Down, ack_of(x)).len() + relay.seen(Dir::Down, refusal_of(x)).len()
    };
    let (before, stale) = (answers(relay), c.h(2).stats().stale_epoch_drops);
    relay.inject(mesh_message::Body::HandoffOffer(offer.clone()));
    let p = Patience::new("an answer to the replayed offer");
    while answers(relay) == before && c.h(2).stats().stale_epoch_drops == stale {
        p.check();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_replayed_offer_gets_the_same_answer_and_never_a_second_adopt() {
    let (mut c, relay) = pair_via_relay().await;
    let mut claims = Claims::default();
    let x = spawn_near_border(&mut c, &mut claims, true).await;
    // Node 2's game is gone when the first offer comes: refused.
    c.drop_game(2).await;
    cross(&mut c, &mut claims, x).await;
    snapshot(c.game(1), x, 1).await;
    c.game(1).expect("Thaw of X", thaw_of(x)).await;
    claims.record(1, Claim::Thaw);
    let refused = relay
        .seen_until(Dir::Up, "the first offer", offer_of(x))
        .await;
    assert_eq!(refused.entity_epoch, 2);
    let first = relay
        .seen_until(Dir::Down, "the refusal", refusal_of(x))
        .await;
    replay(&c, &relay, &refused).await;
    for r in relay.seen(Dir::Down, refusal_of(x)) {
        assert_eq!(r, first, "a replay gets the same refusal");
    }

    // The game is back: the retry is adopted, under an epoch above the refused one.
    c.connect_game(2).await;
    finish(&mut c, &mut claims, x).await;
    assert_eq!(
        claims.expected(x),
        [(2, real(x, 3, false))],
        "{:?}",
        claims.log
    );
    let adopted_offer = relay
        .seen(Dir::Up, offer_of(x))
        .into_iter()
        .find(|o| o.entity_epoch == 3)
        .expect("the offer of epoch 3");

    // Both offers replayed: the same answers again (or dropped as stale), never a second adopt.
    replay(&c, &relay, &adopted_offer).await;
    replay(&c, &relay, &refused).await;
    let acks = relay.seen(Dir::Down, ack_of(x));
    assert!(acks.iter().all(|e| *e == 3), "{acks:?}");
    for r in relay.seen(Dir::Down, refusal_of(x)) {
        assert_eq!(r, first);
    }
    // The ledger fails on a second Adopt, a second Evict or a thaw; the census stays clean.
    for _ in 0..10 {
        c.tick().await;
        play(&mut c, 1, x, &mut claims).await;
        play(&mut c, 2, x, &mut claims).await;
    }
    c.census_until(x, &[(2, real(x, 3, false))]).await;
    let adopts = claims
        .log
        .iter()
        .filter(|(n, c)| *n == 2 && matches!(c, Claim::Start(_)))
        .count();
    assert_eq!(adopts, 1, "{:?}", claims.log);
}

// ---------------------------------------------------------------------------- the fence

fn hp(payload: &str) -> mesh::PublicComponent {
    mesh::PublicComponent {
        r#type: HEALTH,
        payload: Bytes::from(payload.to_string()),
    }
}

fn mesh_at(p: local::Vec3) -> mesh::MeshVec3 {
    mesh::MeshVec3 {
        x: p.x,
        y: p.y,
        z: p.z,
    }
}

fn ghost_hp(components: &[local::Component]) -> Option<&[u8]> {
    components
        .iter()
        .find(|c| c.r#type == HEALTH)
        .map(|c| c.payload.as_ref())
}

#[tokio::test]
async fn the_fence_drops_stale_frames_and_inputs_and_holds_future_frames() {
    // Node 3 is real; nodes 1 and 2 are played by the test (the lower id dials). Node 1 owns the
    // top-left quarter, node 3 the top-right, node 2 the bottom half.
    let mut c = Cluster::plan(2, 2, vec![1, 3, 2, 2]).await;
    c.start(config(3), true).await;
    let mut one = RawPeer::dial(c.h(3).mesh_addr, sidecar_hello(1, 1)).await;
    let mut two = RawPeer::dial(c.h(3).mesh_addr, sidecar_hello(2, 1)).await;
    c.peers_up(3, 2).await;
    c.tick().await;
    // G stands where node 3 subscribes at both (next to its area, so its game perceives G).
    let g_chunk = mesh::ChunkRef { x: 7, y: 7 };
    for link in [&mut one, &mut two] {
        link.expect("node 3's subscription to G's chunk", |m| match m {
            mesh_message::Body::Subscribe(s) if s.chunks.contains(&g_chunk) => Some(()),
            _ => None,
        })
        .await;
    }
    let g = 101;
    let state = |epoch: u64, full: bool, position: Option<local::Vec3>, health: &str| {
        mesh_message::Body::EntityState(mesh::EntityState {
            entity_id: g,
            entity_epoch: epoch,
            full,
            position: position.map(mesh_at),
            components: if full {
                vec![
                    mesh::PublicComponent {
                        r#type: KIND,
                        payload: Bytes::from_static(b"npc:g"),
                    },
                    hp(health),
                ]
            } else {
                vec![hp(health)]
            },
            ..Default::default()
        })
    };
    one.send(state(1, true, Some(chunk(7, 7)), "hp-1")).await;
    let enter = c
        .tick_until_game(3, "G as a ghost", ghost_enter_of(g))
        .await;
    assert_eq!(ghost_hp(&enter.components), Some(b"hp-1".as_slice()));

    // G's next owner writes before the old owner's word that G moved: held, not applied.
    two.send(state(2, true, Some(chunk(7, 7)), "hp-2")).await;
    c.stats_until(3, "the future frame held", |s| s.held_frames == 1)
        .await;
    for _ in 0..5 {
        c.tick().await;
    }
    let early = c
        .game(3)
        .expect_within(Duration::from_millis(50), ghost_update_of(g))
        .await;
    assert!(
        early.is_none(),
        "a frame of epoch 2 applied early: {early:?}"
    );
    one.send(mesh_message::Body::EntityMoved(mesh::EntityMoved {
        entity_id: g,
        entity_epoch: 2,
        owner_node: 2,
        holders: vec![],
    }))
    .await;
    let u = c.tick_until_game(3, "G's update", ghost_update_of(g)).await;
    assert_eq!(ghost_hp(&u.changed), Some(b"hp-2".as_slice()));
    c.stats_until(3, "nothing held", |s| s.held_frames == 0)
        .await;

    // The old owner writes under its old epoch: dropped and counted; the ghost is unchanged.
    let drops = c.h(3).stats().stale_epoch_drops;
    one.send(state(1, false, Some(chunk(6, 6)), "hp-stale"))
        .await;
    c.stats_until(3, "the stale frame dropped", |s| {
        s.stale_epoch_drops > drops
    })
    .await;
    two.send(state(2, false, None, "hp-3")).await;
    let u = c
        .tick_until_game(3, "G's next update", ghost_update_of(g))
        .await;
    assert_eq!(ghost_hp(&u.changed), Some(b"hp-3".as_slice()));
    assert!(u.position.is_none(), "the stale move was applied: {u:?}");

    // Alice's avatar M is handed from node 1 to node 3; her gateway is node 1.
    let m = 201;
    one.send(mesh_message::Body::EntityState(mesh::EntityState {
        entity_id: m,
        entity_epoch: 1,
        full: true,
        position: Some(mesh_at(chunk(9, 4))),
        components: vec![mesh::PublicComponent {
            r#type: KIND,
            payload: Bytes::from_static(b"player:alice"),
        }],
        owner_account: "alice".into(),
        is_master: true,
        ..Default::default()
    }))
    .await;
    c.tick_until_game(3, "M as a ghost", ghost_enter_of(m))
        .await;
    one.send(mesh_message::Body::HandoffOffer(mesh::HandoffOffer {
        entity_id: m,
        entity_epoch: 2,
        partition_epoch: 1,
        position: Some(mesh_at(chunk(9, 4))),
        state: Bytes::from_static(STATE),
        owner_account: "alice".into(),
        is_master: true,
        components: vec![mesh::OwnedComponent {
            r#type: KIND,
            payload: Bytes::from_static(b"player:alice"),
            audience: AudienceKind::PublicInRange as u32,
            accounts: vec![],
        }],
        gateway_node: 1,
        session_epoch: 7,
        ..Default::default()
    }))
    .await;
    let adopt = c.game(3).expect("Adopt of M", adopt_of(m)).await;
    assert_eq!(adopt.entity_epoch, 2);
    adopted(c.game(3), m, 2).await;
    one.expect("the HandoffAck", |b| ack_of(m)(b).filter(|e| *e == 2))
        .await;
    let drops = c.h(3).stats().stale_epoch_drops;
    for (seq, entity_epoch) in [(1, 1), (2, 2)] {
        one.send(mesh_message::Body::ForwardInput(mesh::ForwardInput {
            account: "alice".into(),
            session_epoch: 7,
            seq,
            payload: Bytes::from_static(b"walk"),
            entity_epoch,
            hops: 0,
            entity_id: 0,
        }))
        .await;
    }
    let i = c.game(3).expect("alice's input", input_of("alice")).await;
    assert_eq!(i.seq, 2, "the input of epoch 1 must be dropped");
    assert_eq!(c.h(3).stats().stale_epoch_drops, drops + 1);
    let (_, metrics) = cellmesh_admin::http_get(c.h(3).admin_addr, "/metrics")
        .await
        .unwrap();
    assert!(
        metrics.contains("cellmesh_sidecar_stale_epoch_drops"),
        "{metrics}"
    );
}

// ---------------------------------------------------------------------------- the lease

/// Any Freeze, as (entity, epoch).
fn freeze_any(m: &ToGame) -> Option<(u64, u64)> {
    match m {
        ToGame::Freeze(f) => Some((f.entity_id, f.entity_epoch)),
        _ => None,
    }
}

/// The store stops answering for longer than a lease (a MongoDB election, a paused server, a
/// cut), then answers again, nobody having taken the id meanwhile.
#[tokio::test]
async fn a_node_cut_off_from_the_topology_store_freezes_at_its_lease_deadline_and_thaws_when_it_answers(
) {
    let mut c = Cluster::plan(2, 1, vec![1, 2]).await;
    let mut cfg = config(1);
    cfg.node_lease_ms = 2_000;
    let lease = Duration::from_millis(cfg.node_lease_ms);
    c.start(cfg, true).await;
    let a = c.id(1);
    c.game(1).push(npc(a, chunk(2, 2)));
    c.tick().await;
    let p = Patience::new("the entity in the census");
    while c.census(a) != vec![(1, real(a, 1, false))] {
        p.check();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The store neither answers nor refuses: no renewal lands, and nothing says the lease is
    // gone. The node must stop on its own clock, at its deadline, before the store's expiry
    // could let another process have its id.
    c.store_cut[&1].store(true, Ordering::SeqCst);
    let cut_at = Instant::now();
    let f = c.game(1).expect("Freeze", freeze_any).await;
    let after = cut_at.elapsed();
    assert_eq!(f, (a, 1));
    // A lease after the last renewal left (at most a half-second round before the cut), not
    // after a store timeout (5 s): generous for a loaded machine, still well short of that.
    assert!(
        after <= lease + Duration::from_millis(1_500),
        "froze {after:?} after the cut"
    );
    let p = Patience::new("node 1 not ready and its entity frozen");
    while c.ready(1).await != 503 || c.census(a) != vec![(1, real(a, 1, true))] {
        p.check();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The store answers again: the lease, lapsed but still this process's grant, is taken back
    // under its epoch, and what the lapse froze thaws. The process never stopped.
    c.store_cut[&1].store(false, Ordering::SeqCst);
    let reason = c
        .game(1)
        .expect("Thaw", |m| match m {
            ToGame::Thaw(t) if t.entity_id == a => Some(t.reason.clone()),
            _ => None,
        })
        .await;
    assert!(reason.contains("lease is back"), "{reason}");
    assert!(!c.nodes[&1].stop.is_cancelled(), "the sidecar exited");
    let p = Patience::new("node 1 ready again, writing its entity");
    while c.ready(1).await != 200 || c.census(a) != vec![(1, real(a, 1, false))] {
        p.check();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lease_now = c.topology.nodes().await.unwrap();
    let mine = lease_now.iter().find(|e| e.lease.node == 1).unwrap();
    assert!(mine.live, "{mine:?}");
    let (_, metrics) = cellmesh_admin::http_get(c.h(1).admin_addr, "/metrics")
        .await
        .unwrap();
    assert!(
        metrics.contains("cellmesh_sidecar_leases_reclaimed_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_node_that_lost_its_lease_freezes_everything_it_owns() {
    let mut c = Cluster::plan(2, 1, vec![1, 2]).await;
    let cfg = config(1);
    let lease = Duration::from_millis(cfg.node_lease_ms);
    c.start(cfg, true).await;
    let (a, b) = (c.id(1), c.id(1));
    c.game(1).push(npc(a, chunk(2, 2)));
    c.game(1).push(npc(b, chunk(3, 12)));
    c.tick().await;
    let both = |frozen| {
        let mut v = vec![(1, real(a, 1, frozen)), (1, real(b, 1, frozen))];
        v.sort_by_key(|r| r.1.id);
        v
    };
    let census = |c: &Cluster| {
        let mut v = c.census(a);
        v.extend(c.census(b));
        v.sort_by_key(|r| r.1.id);
        v
    };
    let p = Patience::new("both entities in the census");
    while census(&c) != both(false) {
        p.check();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(c.ready(1).await, 200);

    // A contender cannot take a live lease, however its own clock runs: the store judges.
    let refused = c
        .topology
        .acquire_lease(1, "another-process", lease)
        .await
        .unwrap();
    assert!(matches!(refused, Acquire::Held(_)), "{refused:?}");
    // The store's clock jumps past node 1's expiry: its next renewal is refused, and another
    // holder takes the id.
    c.store_ahead_ms
        .store(lease.as_millis() as u64 + 1_000, Ordering::SeqCst);
    let taken = c
        .topology
        .acquire_lease(1, "another-process", lease)
        .await
        .unwrap();
    assert!(matches!(taken, Acquire::Granted(_)), "{taken:?}");

    let mut frozen = BTreeSet::new();
    while frozen.len() < 2 {
        let f = c.game(1).expect("Freeze", freeze_any).await;
        frozen.insert(f);
    }
    assert_eq!(frozen, BTreeSet::from([(a, 1), (b, 1)]));
    // Every freeze reached the game before the sidecar stopped by itself, saying why.
    c.exited_for_lost_lease(1).await;
}
