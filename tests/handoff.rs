//! Handoffs in a whole cluster over real loopback sockets: four sidecars, each with an arena, share
//! a small torus on a 2×2 grid; clients log in through a proxy and check everything they see
//! while their avatars and their neighbours are handed from node to node.
//!
//! The world is 512 m square in 32 m chunks (16×16 chunks, 4×4 regions of 128 m), shared on the
//! 2×2 grid `cellmesh up` lays out: a quadrant of 8×8 chunks per node. Node 1 owns x and y in
//! [0, 256); node 2 owns x in [256, 512) of those rows, node 3 y in [256, 512) of those columns,
//! node 4 the rest. All four meet at the corner (0, 0), across the wrap seams.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use cellmesh::up::{run, UpOptions};
use cellmesh_arena::{schema, ArenaConfig, ArenaStats, Census};
use cellmesh_geo_router::geometry::WorldShape;
use cellmesh_geo_router::partition::{Grid, Layout, Partition};
use cellmesh_geo_router::store::Stores;
use cellmesh_geo_router::topology::memory::MemoryTopology;
use cellmesh_geo_router::topology::{Commit, TopologyStore};
use cellmesh_proto::client::{self, ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, Batch, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WORLD: WorldShape = WorldShape {
    width: 512.0,
    height: 512.0,
    chunk_size: 32.0,
    region_size: 128.0,
};
const NODES: [u32; 4] = [1, 2, 3, 4];
const SECRET: &str = "handoff-tests-secret";
/// The sidecars' default view radius: an entity this close to a client is in its view.
const VIEW_RADIUS_CHUNKS: i64 = 5;
/// An entity last seen this close (in chunks) must not vanish unless a game despawned it: the
/// view keeps chunks up to a chunk beyond its radius, and this leaves one more for rounding.
const GUARD_CHUNKS: i64 = VIEW_RADIUS_CHUNKS - 1;
/// Inputs a walking client sends per second: well below the proxy's per-account limit.
const INPUT_INTERVAL: Duration = Duration::from_millis(100);

/// Each test runs a whole cluster; one at a time, so none starves another of the CPU.
static ONE_CLUSTER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

async fn within<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {limit:?}"))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

/// The shortest signed step from `a` to `b` along an axis of length `size`.
fn wrap_delta(a: f64, b: f64, size: f64) -> f64 {
    let d = b - a;
    d - (d / size).round() * size
}

fn step_to(from: (f64, f64), to: (f64, f64)) -> (f64, f64) {
    (
        wrap_delta(from.0, to.0, WORLD.width),
        wrap_delta(from.1, to.1, WORLD.height),
    )
}

/// Chebyshev distance in metres on the torus.
fn metres_apart(a: (f64, f64), b: (f64, f64)) -> f64 {
    let (dx, dy) = step_to(a, b);
    dx.abs().max(dy.abs())
}

/// Chebyshev distance between the chunks of two positions, on the torus.
fn chunks_apart(a: (f64, f64), b: (f64, f64)) -> i64 {
    let chunk = |v: f64, size: f64| (v.rem_euclid(size) / WORLD.chunk_size).floor() as i64;
    let axis = |a: f64, b: f64, size: f64| {
        let n = (size / WORLD.chunk_size).round() as i64;
        let d = (chunk(a, size) - chunk(b, size)).rem_euclid(n);
        d.min(n - d)
    };
    axis(a.0, b.0, WORLD.width).max(axis(a.1, b.1, WORLD.height))
}

/// How a test's cluster is set up.
#[derive(Clone, Copy)]
struct Setup {
    npcs_per_node: u32,
    /// NPCs and new players appear (and NPCs roam) in a square this wide around (0, 0).
    spread: f64,
    /// Metres per second a player walks.
    player_speed: f64,
}

/// Four sidecars on a 2×2 grid, an arena on each, and one proxy in front.
struct Cluster {
    topology: Arc<MemoryTopology>,
    sidecars: Vec<SidecarHandle>,
    arenas: Vec<JoinHandle<anyhow::Result<ArenaStats>>>,
    proxy: ProxyHandle,
    census: Arc<Census>,
    stop: CancellationToken,
}

impl Cluster {
    async fn start(setup: Setup) -> Self {
        let stop = CancellationToken::new();
        let stores = Stores::in_memory();
        let grid = Grid::even(&WORLD, 4, 4, &NODES).expect("a 2×2 grid of 4×4 regions");
        let partition = Partition::new(WORLD, 1, Layout::Grid(grid)).expect("the partition");
        let topology = Arc::new(MemoryTopology::default());
        let commit = topology.commit_partition(0, &partition).await.unwrap();
        assert_eq!(commit, Commit::Committed);
        let shared: Arc<dyn TopologyStore> = topology.clone();

        let census = Arc::new(Census::default());
        let mut sidecars = Vec::new();
        let mut arenas = Vec::new();
        for node_id in NODES {
            let cfg = SidecarConfig {
                node_id,
                world: WORLD,
                local_listen: "127.0.0.1:0".into(),
                mesh_listen: "127.0.0.1:0".into(),
                admin_listen: "127.0.0.1:0".into(),
                ..SidecarConfig::default()
            };
            let sidecar =
                cellmesh_sidecar::start_in(cfg, stores.clone(), shared.clone(), stop.child_token())
                    .await
                    .unwrap_or_else(|e| panic!("sidecar of node {node_id}: {e:#}"));
            let arena = ArenaConfig {
                sidecar: SidecarAddr::Tcp(sidecar.local_addr.clone()),
                npcs: setup.npcs_per_node,
                center: (0.0, 0.0),
                spread: setup.spread,
                tick_hz: 20,
                seed: u64::from(node_id),
                player_speed: setup.player_speed,
                census: Some(census.clone()),
                ..ArenaConfig::default()
            };
            let arena_stop = stop.child_token();
            arenas.push(tokio::spawn(cellmesh_arena::run(arena, async move {
                arena_stop.cancelled().await
            })));
            sidecars.push(sidecar);
        }
        let proxy = cellmesh_proxy::start(
            ProxyConfig {
                client_listen: "127.0.0.1:0".into(),
                admin_listen: "127.0.0.1:0".into(),
                gateways: sidecars.iter().map(|s| s.mesh_addr.to_string()).collect(),
                token_secret: SECRET.into(),
                ..ProxyConfig::default()
            },
            stop.child_token(),
        )
        .await
        .expect("the proxy starts");
        let cluster = Self {
            topology,
            sidecars,
            arenas,
            proxy,
            census,
            stop,
        };
        within("the cluster linking up", Duration::from_secs(30), async {
            while !cluster.ready() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        cluster
    }

    fn ready(&self) -> bool {
        let linked = self.sidecars.iter().all(|s| {
            let st = s.stats();
            st.game_connected && st.peers_up as usize == NODES.len() - 1
        });
        linked && self.proxy.admin.is_ready()
    }

    fn proxy_addr(&self) -> String {
        self.proxy.client_addr.to_string()
    }

    fn sidecar(&self, node: u32) -> &SidecarHandle {
        &self.sidecars[NODES.iter().position(|&n| n == node).expect("a node id")]
    }

    fn handoffs(&self) -> u64 {
        self.sidecars.iter().map(|s| s.stats().handoffs).sum()
    }

    fn in_doubt(&self) -> u64 {
        self.sidecars.iter().map(|s| s.stats().in_doubt_now).sum()
    }

    fn sidecar_errors(&self) -> Vec<(u32, u64)> {
        NODES
            .iter()
            .zip(&self.sidecars)
            .map(|(&n, s)| (n, s.stats().errors))
            .filter(|(_, e)| *e > 0)
            .collect()
    }

    /// The entity `id` as its (unfrozen) owner writes it: (node, epoch).
    fn owner_of(&self, id: u64) -> Option<(u32, u64)> {
        NODES.iter().zip(&self.sidecars).find_map(|(&n, s)| {
            s.reals()
                .into_iter()
                .find(|r| r.id == id && !r.frozen)
                .map(|r| (n, r.epoch))
        })
    }

    /// One census: what the games hold against what every sidecar writes.
    fn census(&self) -> CensusRead {
        let report = self.census.report();
        let mut writers: BTreeMap<u64, Vec<(u32, bool)>> = BTreeMap::new();
        for (&node, s) in NODES.iter().zip(&self.sidecars) {
            for r in s.reals() {
                writers.entry(r.id).or_default().push((node, r.frozen));
            }
        }
        let mut faults = BTreeMap::new();
        for id in report.lost() {
            faults.insert(id, "alive, held by no game".to_string());
        }
        for id in report.duplicated() {
            let holders = &report.holders[&id];
            faults.insert(id, format!("held by the games of nodes {holders:?}"));
        }
        for id in &report.alive {
            let w = writers.get(id).map(Vec::as_slice).unwrap_or_default();
            if w.iter().filter(|(_, frozen)| !frozen).count() != 1 {
                faults
                    .entry(*id)
                    .or_insert_with(|| format!("sidecar reals (node, frozen): {w:?}"));
            }
        }
        for (id, w) in &writers {
            if !report.alive.contains(id) {
                faults.insert(*id, format!("written by {w:?}, but no game spawned it"));
            }
        }
        CensusRead {
            faults,
            alive: report.alive.len(),
            held_by: report
                .holders
                .values()
                .flatten()
                .fold(BTreeMap::new(), |mut m, &node| {
                    *m.entry(node).or_insert(0) += 1;
                    m
                }),
        }
    }

    /// Stops everything; the arenas' own counts.
    async fn stop(self) -> Vec<ArenaStats> {
        self.stop.cancel();
        let mut stats = Vec::new();
        for arena in self.arenas {
            let st = within("an arena stopping", Duration::from_secs(10), arena)
                .await
                .expect("the arena task")
                .expect("the arena ran");
            stats.push(st);
        }
        within(
            "the proxy stopping",
            Duration::from_secs(10),
            self.proxy.wait(),
        )
        .await;
        for s in self.sidecars {
            within("a sidecar stopping", Duration::from_secs(10), s.wait()).await;
        }
        stats
    }
}

/// What one census found: entities not exactly once in the world, and why.
#[derive(Debug)]
struct CensusRead {
    faults: BTreeMap<u64, String>,
    alive: usize,
    /// Entities each node's game holds.
    held_by: BTreeMap<u32, usize>,
}

/// What a client saw of the world, checked as each batch arrives.
struct Seen {
    account: String,
    census: Arc<Census>,
    my_id: Option<u64>,
    /// Entities in view, where each was last seen.
    in_view: HashMap<u64, (f64, f64)>,
    inventory: Option<Bytes>,
    /// The game's latest acknowledgement of this client's inputs: (last seq, inputs applied).
    ack: (u64, u64),
    batches: u64,
    /// Vanishes of entities beyond the guard distance (out of range, or despawned).
    vanishes: u64,
    /// Entities that vanished from within the guard distance: the tick they vanished.
    gone: HashMap<u64, u64>,
    faults: Vec<String>,
}

impl Seen {
    fn new(account: &str, census: Arc<Census>) -> Self {
        Self {
            account: account.to_string(),
            census,
            my_id: None,
            in_view: HashMap::new(),
            inventory: None,
            ack: (0, 0),
            batches: 0,
            vanishes: 0,
            gone: HashMap::new(),
            faults: Vec::new(),
        }
    }

    fn my_pos(&self) -> Option<(f64, f64)> {
        self.my_id.and_then(|id| self.in_view.get(&id).copied())
    }

    fn fault(&mut self, what: String) {
        tracing::error!(account = %self.account, "{what}");
        self.faults.push(what);
    }

    fn apply(&mut self, b: &Batch) {
        self.batches += 1;
        let me = format!("player:{}", self.account);
        for d in &b.deltas {
            let id = d.entity_id;
            let pos = d.position.as_ref().map(|p| (p.x, p.y));
            let mine = Some(id) == self.my_id
                || d.components
                    .iter()
                    .any(|c| c.r#type == schema::KIND && c.payload == me.as_bytes());
            if !mine {
                let private = d
                    .components
                    .iter()
                    .map(|c| c.r#type)
                    .filter(|t| [schema::INVENTORY, schema::INPUT_ACK].contains(t))
                    .collect::<Vec<_>>();
                if !private.is_empty() {
                    self.fault(format!(
                        "tick {}: saw owner-only components {private:?} of entity {id}, not its own",
                        b.tick
                    ));
                }
            }
            match DeltaKind::try_from(d.kind) {
                Ok(DeltaKind::Appear) => {
                    let Some(pos) = pos else {
                        self.fault(format!(
                            "tick {}: entity {id} appeared without a position",
                            b.tick
                        ));
                        continue;
                    };
                    if let Some(tick) = self.gone.remove(&id) {
                        self.fault(format!(
                            "tick {}: entity {id} appeared again, {} ticks after it vanished",
                            b.tick,
                            b.tick.saturating_sub(tick)
                        ));
                    }
                    if self.in_view.insert(id, pos).is_some() {
                        self.fault(format!(
                            "tick {}: entity {id} appeared again while in view",
                            b.tick
                        ));
                    }
                    if mine {
                        if self.my_id.is_some_and(|m| m != id) {
                            self.fault(format!(
                                "tick {}: a second avatar {id} (first {:?})",
                                b.tick, self.my_id
                            ));
                        }
                        self.my_id = Some(id);
                        self.inventory = None;
                        self.apply_own(b.tick, d);
                        if self.inventory.is_none() {
                            self.fault(format!(
                                "tick {}: own entity appeared without its inventory",
                                b.tick
                            ));
                        }
                    }
                }
                Ok(DeltaKind::Update) => {
                    if !self.in_view.contains_key(&id) {
                        self.fault(format!(
                            "tick {}: update of entity {id}, not in view",
                            b.tick
                        ));
                    }
                    if let Some(pos) = pos {
                        self.in_view.insert(id, pos);
                    }
                    if mine {
                        self.apply_own(b.tick, d);
                    }
                }
                Ok(DeltaKind::Vanish) => {
                    if mine {
                        self.fault(format!("tick {}: own entity {id} vanished", b.tick));
                    }
                    let Some(was) = self.in_view.remove(&id) else {
                        self.fault(format!(
                            "tick {}: vanish of entity {id}, not in view",
                            b.tick
                        ));
                        continue;
                    };
                    let near = self.my_pos().map(|p| chunks_apart(p, was));
                    if near.is_some_and(|n| n <= GUARD_CHUNKS) && !self.census.is_despawned(id) {
                        self.gone.insert(id, b.tick);
                        self.fault(format!(
                            "tick {}: entity {id} vanished {near:?} chunks away (at {was:?}, me at {:?}) and no game despawned it",
                            b.tick,
                            self.my_pos()
                        ));
                    } else {
                        self.vanishes += 1;
                    }
                }
                Err(_) => self.fault(format!("tick {}: delta kind {} unknown", b.tick, d.kind)),
            }
        }
    }

    /// The components of this client's own entity: the inventory never changes, and the input
    /// acknowledgement never goes back.
    fn apply_own(&mut self, tick: u64, d: &cellmesh_proto::edge::EntityDelta) {
        if d.removed_types.contains(&schema::INVENTORY) {
            self.fault(format!("tick {tick}: own inventory removed"));
        }
        for c in &d.components {
            match c.r#type {
                schema::INVENTORY => {
                    if c.payload != Bytes::from_static(b"sword,bread,10 gold") {
                        self.fault(format!("tick {tick}: own inventory is {:?}", c.payload));
                    }
                    self.inventory = Some(c.payload.clone());
                }
                schema::INPUT_ACK => match schema::parse_input_ack(&c.payload) {
                    Some(ack) if ack.0 >= self.ack.0 && ack.1 >= self.ack.1 => self.ack = ack,
                    other => {
                        let was = self.ack;
                        self.fault(format!(
                            "tick {tick}: input ack went from {was:?} to {other:?}"
                        ));
                    }
                },
                _ => {}
            }
        }
    }
}

/// A logged-in client.
struct Player {
    tx: ClientSender,
    rx: ClientReceiver,
    seen: Seen,
    /// The last input seq sent.
    seq: u64,
    gateway: u32,
}

impl Player {
    async fn login(proxy: &str, account: &str, census: Arc<Census>) -> Self {
        let token = cellmesh_proto::token::sign(SECRET.as_bytes(), account, unix_now() + 3600);
        let (tx, rx, welcome) = within(
            "login",
            Duration::from_secs(10),
            client::login(proxy, &token),
        )
        .await
        .unwrap_or_else(|e| panic!("{account} logs in: {e}"));
        assert_eq!(
            (welcome.world_width, welcome.world_height),
            (WORLD.width, WORLD.height)
        );
        tracing::info!(account, gateway = welcome.gateway_node, "logged in");
        let mut p = Self {
            tx,
            rx,
            seen: Seen::new(account, census),
            seq: 0,
            gateway: welcome.gateway_node,
        };
        let appeared = p
            .pump_until(Duration::from_secs(10), |s| s.my_pos().is_some())
            .await;
        assert!(appeared, "{account}'s avatar never appeared");
        p
    }

    /// Reads one message from the proxy and takes it in; `false` once the session is over.
    async fn pump(&mut self) -> bool {
        match self.rx.next().await {
            Some(Ok(m)) => match m.body {
                Some(server_message::Body::Batch(b)) => self.seen.apply(&b),
                Some(server_message::Body::Ping(p)) => {
                    let pong = client_message::Body::Pong(Pong { nonce: p.nonce });
                    if let Err(e) = self.tx.send(pong).await {
                        self.seen.fault(format!("answering a ping: {e}"));
                        return false;
                    }
                }
                Some(server_message::Body::Kick(k)) => {
                    self.seen.fault(format!("kicked: {k:?}"));
                    return false;
                }
                _ => {}
            },
            Some(Err(e)) => {
                self.seen.fault(format!("reading from the proxy: {e}"));
                return false;
            }
            None => {
                self.seen.fault("the proxy closed the connection".into());
                return false;
            }
        }
        true
    }

    /// Takes in what arrives until `done` holds; `false` if it did not within `limit`.
    async fn pump_until(&mut self, limit: Duration, done: impl Fn(&Seen) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while !done(&self.seen) {
            match tokio::time::timeout_at(deadline, self.pump()).await {
                Ok(true) => {}
                Ok(false) | Err(_) => return false,
            }
        }
        true
    }

    /// Sends the next input: walk towards `to` (the short way round), or stop.
    async fn head(&mut self, to: Option<(f64, f64)>) {
        let (dx, dy) = match (to, self.seen.my_pos()) {
            (Some(to), Some(at)) => step_to(at, to),
            _ => (0.0, 0.0),
        };
        self.seq += 1;
        if let Err(e) = self
            .tx
            .input(self.seq, schema::input(dx as f32, dy as f32))
            .await
        {
            self.seen.fault(format!("sending input {}: {e}", self.seq));
        }
    }

    /// Walks through `route` (coming within `reach` metres of each point in turn), steering
    /// [`INPUT_INTERVAL`] apart, then stops and waits until the game acknowledged every input.
    async fn walk(&mut self, route: &[(f64, f64)], reach: f64) {
        let mut leg = 0;
        let mut steer = tokio::time::interval(INPUT_INTERVAL);
        steer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while leg < route.len() {
            tokio::select! {
                alive = self.pump() => {
                    if !alive {
                        return;
                    }
                    let at = self.seen.my_pos();
                    if at.is_some_and(|p| metres_apart(p, route[leg]) <= reach) {
                        leg += 1;
                        // Turn at once, not up to an input interval later.
                        self.head(route.get(leg).copied()).await;
                        steer.reset();
                    }
                }
                _ = steer.tick() => self.head(Some(route[leg])).await,
            }
        }
        let sent = self.seq;
        let acked = self
            .pump_until(Duration::from_secs(10), |s| s.ack == (sent, sent))
            .await;
        if !acked {
            let ack = self.seen.ack;
            self.seen.fault(format!(
                "sent inputs 1..={sent} once each; the game acknowledged (last seq, applied) = {ack:?}"
            ));
        }
    }

    /// Takes in what arrives until `stop`, then says goodbye.
    async fn watch(mut self, stop: CancellationToken) -> Report {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                alive = self.pump() => if !alive { break },
            }
        }
        let report = Report {
            account: self.seen.account,
            gateway: self.gateway,
            my_id: self.seen.my_id,
            in_view: self.seen.in_view.keys().copied().collect(),
            inputs_sent: self.seq,
            ack: self.seen.ack,
            batches: self.seen.batches,
            vanishes: self.seen.vanishes,
            faults: self.seen.faults,
        };
        let _ = self.tx.close().await;
        report
    }
}

/// What a client reports at the end.
#[derive(Debug)]
struct Report {
    account: String,
    gateway: u32,
    my_id: Option<u64>,
    /// Entities in view at the end.
    in_view: BTreeSet<u64>,
    inputs_sent: u64,
    ack: (u64, u64),
    batches: u64,
    vanishes: u64,
    faults: Vec<String>,
}

/// Logs in, walks `route`, tells `walked` (account, avatar id), and watches until `stop`.
fn spawn_walker(
    proxy: String,
    account: String,
    census: Arc<Census>,
    route: Vec<(f64, f64)>,
    reach: f64,
    walked: mpsc::UnboundedSender<(String, Option<u64>)>,
    stop: CancellationToken,
) -> JoinHandle<Report> {
    tokio::spawn(async move {
        let mut p = Player::login(&proxy, &account, census).await;
        p.walk(&route, reach).await;
        let _ = walked.send((account, p.seen.my_id));
        p.watch(stop).await
    })
}

fn assert_no_faults(reports: &[Report]) {
    let faults: Vec<String> = reports
        .iter()
        .flat_map(|r| r.faults.iter().map(move |f| format!("{}: {f}", r.account)))
        .collect();
    assert!(
        faults.is_empty(),
        "clients saw {} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

fn assert_arenas_clean(arenas: &[ArenaStats]) {
    for (node, a) in NODES.iter().zip(arenas) {
        assert_eq!(
            (a.inputs_duplicate, a.errors_from_sidecar),
            (0, 0),
            "node {node}'s arena got inputs twice or errors: {a:?}"
        );
    }
}

/// The corners of a square centred on (0, 0), 160 m a side: each 80 m (2.5 chunks) into its
/// quadrant, so each side crosses a wrap seam and hands the avatar to the next node.
const SQUARE: [(f64, f64); 4] = [(80.0, 80.0), (432.0, 80.0), (432.0, 432.0), (80.0, 432.0)];
const LAPS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walker_crosses_all_four_nodes_twenty_times_and_sees_nothing_vanish() {
    init_logs();
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    // 16 m a tick: a lap of 640 m in two seconds.
    let cluster = Cluster::start(Setup {
        npcs_per_node: 4,
        spread: 160.0,
        player_speed: 320.0,
    })
    .await;
    // To the first corner, then twenty laps.
    let route: Vec<(f64, f64)> = std::iter::once(SQUARE[0])
        .chain(SQUARE.iter().copied().cycle().skip(1).take(4 * LAPS))
        .collect();
    let stop = CancellationToken::new();
    let (walked_tx, mut walked) = mpsc::unbounded_channel();
    // Two walkers on the same square: each is a neighbour handed off with the other.
    let walkers: Vec<_> = ["walker-a", "walker-b"]
        .into_iter()
        .map(|account| {
            spawn_walker(
                cluster.proxy_addr(),
                account.into(),
                cluster.census.clone(),
                route.clone(),
                20.0,
                walked_tx.clone(),
                stop.clone(),
            )
        })
        .collect();
    drop(walked_tx);
    let mut avatars = Vec::new();
    within("the walks", Duration::from_secs(180), async {
        while avatars.len() < walkers.len() {
            avatars.push(walked.recv().await.expect("a walker finished or failed"));
        }
    })
    .await;

    // Each handoff raises the entity's epoch by one: count the avatars' own.
    let mut avatar_handoffs = Vec::new();
    for (account, id) in &avatars {
        let id = id.unwrap_or_else(|| panic!("{account} never saw its avatar"));
        let owner = within("the avatar's owner", Duration::from_secs(5), async {
            loop {
                if let Some(o) = cluster.owner_of(id) {
                    break o;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        avatar_handoffs.push((account.clone(), owner.1 - 1));
    }
    let handoffs = cluster.handoffs();
    // (node, completed as source, refused, frames held for a later epoch)
    let per_node: Vec<(u32, u64, u64, u64)> = NODES
        .iter()
        .zip(&cluster.sidecars)
        .map(|(&n, s)| {
            let st = s.stats();
            (n, st.handoffs, st.handoffs_refused, st.held_frames)
        })
        .collect();
    let proxy = cluster.proxy.stats();
    let errors = cluster.sidecar_errors();
    stop.cancel();
    let reports: Vec<Report> = join_all(walkers).await;
    let arenas = cluster.stop().await;

    for r in &reports {
        eprintln!(
            "{}: avatar {:?}, {} inputs, ack {:?}, {} batches, {} vanishes out of range",
            r.account, r.my_id, r.inputs_sent, r.ack, r.batches, r.vanishes
        );
    }
    eprintln!("avatar epochs - 1 {avatar_handoffs:?}; handoffs in all {handoffs}, (node, completed, refused, held frames) {per_node:?}");
    assert_no_faults(&reports);
    for r in &reports {
        assert_eq!(r.ack, (r.inputs_sent, r.inputs_sent), "{r:?}");
    }
    // Four a lap, and up to three more on the way from where it appeared to the first corner.
    let laps = LAPS as u64;
    for (account, n) in &avatar_handoffs {
        assert!(
            (4 * laps..=4 * laps + 3).contains(n),
            "{account}'s avatar was handed off {n} times in {laps} laps; (node, completed, refused, held frames) {per_node:?}"
        );
    }
    let total: u64 = avatar_handoffs.iter().map(|(_, n)| n).sum();
    assert!(
        handoffs >= total,
        "sidecars count {handoffs} handoffs, the avatars {total}"
    );
    assert_eq!((proxy.inputs_dropped, proxy.kicks), (0, 0), "{proxy:?}");
    assert!(
        errors.is_empty(),
        "sidecar errors (node, count): {errors:?}"
    );
    assert_arenas_clean(&arenas);
}

async fn join_all<T: Send + 'static>(tasks: Vec<JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(
            within("a client finishing", Duration::from_secs(10), t)
                .await
                .expect("the client task"),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replan_without_node_4_hands_all_its_entities_to_the_others() {
    init_logs();
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    // NPCs roam 4 chunks around the corner, in every quadrant.
    let cluster = Cluster::start(Setup {
        npcs_per_node: 10,
        spread: 256.0,
        player_speed: 40.0,
    })
    .await;
    // Watchers stand in the corner's chunk: everything the arenas hold is within 4 chunks of them,
    // always in view.
    let stop = CancellationToken::new();
    let (walked_tx, mut walked) = mpsc::unbounded_channel();
    let watchers: Vec<_> = (0..3)
        .map(|i| {
            spawn_walker(
                cluster.proxy_addr(),
                format!("watcher-{i}"),
                cluster.census.clone(),
                vec![(16.0, 16.0)],
                6.0,
                walked_tx.clone(),
                stop.clone(),
            )
        })
        .collect();
    drop(walked_tx);
    within(
        "the watchers taking their places",
        Duration::from_secs(30),
        async {
            for _ in 0..watchers.len() {
                walked.recv().await.expect("a watcher failed");
            }
        },
    )
    .await;

    // The world as the 2×2 grid left it: node 4 holds its share, nothing lost or doubled.
    let settled = within("the first census", Duration::from_secs(20), async {
        loop {
            let c = cluster.census();
            if c.faults.is_empty() && cluster.in_doubt() == 0 {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let node4_before = cluster.sidecar(4).reals().len();
    assert!(
        node4_before > 0 && settled.held_by.get(&4).is_some_and(|&n| n > 0),
        "node 4 holds nothing to hand off: {settled:?}"
    );
    let node4_handoffs = cluster.sidecar(4).stats().handoffs;

    // As `cellmesh partition plan --nodes 1,2,3 --commit` re-plans it.
    let current = cluster
        .topology
        .partition()
        .await
        .unwrap()
        .expect("epoch 1");
    let grid = Grid::even(&WORLD, 4, 4, &[1, 2, 3]).unwrap();
    let next = current.successor(Layout::Grid(grid)).unwrap();
    tracing::info!("committing epoch 2");
    let commit = cluster.topology.commit_partition(1, &next).await.unwrap();
    assert_eq!(commit, Commit::Committed);

    let mut last = None;
    let done = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let c = cluster.census();
            let node4 = cluster.sidecar(4).reals();
            let in_doubt = cluster.in_doubt();
            if c.faults.is_empty()
                && node4.is_empty()
                && in_doubt == 0
                && !c.held_by.contains_key(&4)
            {
                break c;
            }
            last = Some((c, node4, in_doubt));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let after = done.unwrap_or_else(|_| {
        panic!(
            "node 4 did not hand everything off; last census, node 4's reals, in doubt: {last:#?}"
        )
    });
    // Watch a little longer for late vanishes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Frames a node holds for an epoch it has not seen yet (waiting for the entity's move).
    let held: Vec<(u32, u64)> = NODES
        .iter()
        .zip(&cluster.sidecars)
        .map(|(&n, s)| (n, s.stats().held_frames))
        .collect();
    let moved = cluster.sidecar(4).stats().handoffs - node4_handoffs;
    let errors = cluster.sidecar_errors();
    let alive = cluster.census.report().alive;
    stop.cancel();
    let reports = join_all(watchers).await;
    let arenas = cluster.stop().await;

    eprintln!("before {settled:?}, node 4 held {node4_before}; after {after:?}; node 4 handed off {moved}");
    // Everything is within the guard distance of every watcher: each must see it all.
    let unseen: Vec<(&str, u32, Vec<u64>)> = reports
        .iter()
        .map(|r| {
            let missing = alive.difference(&r.in_view).copied().collect();
            (r.account.as_str(), r.gateway, missing)
        })
        .filter(|(_, _, missing): &(_, _, Vec<u64>)| !missing.is_empty())
        .collect();
    eprintln!("(watcher, gateway node, entities it does not see): {unseen:?}");
    eprintln!("frames held for a later epoch (node, frames): {held:?}");
    assert_no_faults(&reports);
    assert!(
        unseen.is_empty(),
        "watchers miss entities in their view (watcher, gateway node, entities): {unseen:?}"
    );
    assert_eq!(
        after.alive, settled.alive,
        "no game spawned or despawned meanwhile"
    );
    assert!(
        moved >= node4_before as u64,
        "node 4 held {node4_before} entities but handed off {moved}"
    );
    assert!(
        errors.is_empty(),
        "sidecar errors (node, count): {errors:?}"
    );
    assert_arenas_clean(&arenas);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_four_nodes_hands_off_without_loss_duplication_or_vanishes() {
    init_logs();
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let opts = UpOptions {
        bots: 20,
        npcs: 40,
        nodes: 4,
        duration: Some(Duration::from_secs(15)),
        summary_json: None,
        seed: 11,
        status: false,
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    assert!(s.handoffs > 0, "no handoffs: {s:?}");
    assert_eq!(
        (
            s.vanished_on_handoff,
            s.entities_lost,
            s.entities_duplicated,
            s.in_doubt_now,
            s.errors
        ),
        (0, 0, 0, 0, 0),
        "(vanished on handoff, lost, duplicated, in doubt, errors): {s:?}"
    );
    assert!(s.census_at_rest, "the world did not come to rest: {s:?}");
    assert_eq!(s.inputs_unaccounted, 0, "inputs unaccounted for: {s:?}");
}
