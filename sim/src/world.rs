//! The simulated cluster: sidecar cores with their games, the links between them, the real
//! proxies in front of them with their clients (see `edge`), and the stores, all in virtual time. One seed draws every delay, fault
//! and choice, so one seed reproduces one run exactly.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use cellmesh_arena::{Arena, ArenaConfig, ArenaStats, Census};
use cellmesh_proto::local::{self, game_message, sidecar_message, GameMessage, SidecarFrame};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage, PeerRole};
use cellmesh_sidecar::core::{
    ConnId, Core, Input, LeaseTerms, LinkId, Now, Output, PeerInfo, StoreReply, StoreRequest,
};
use cellmesh_sidecar::SidecarConfig;
use cellmesh_stores::topology::{self, Lease};
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Bsp, Grid, Layout, NodeId, Partition};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check::Checker;
use crate::client::Client;
use crate::director::{max_over_avg, Balance, BubbleFigures, Director, Sample};
use crate::leases::{Answer, Clock, SimLeases};
use crate::scenario::{Delay, Fault, FaultPlan, LayoutKind, Scenario};
use crate::store::SimStore;

mod edge;
use edge::{ProxyLink, SimProxy};

/// The wall clock the simulation starts at (any fixed value: runs must not depend on the day).
const START_UNIX_MS: u64 = 1_800_000_000_000;
/// Mixed into the run's seed for the boards' far probes (see `Sim::probe_rng`).
const PROBE_STREAM: u64 = 0x7072_6f62_6573;
/// Delay between a sidecar and its game on the same machine.
const LOCAL_DELAY: Delay = Delay::ms(0, 1);
/// Clients stop sending this long before the end, so every input lands before the count.
const INPUTS_STOP_BEFORE_END_MS: u64 = 1_000;
/// Chunks from a client's avatar within which nothing may vanish while it exists.
const INSIDE_VIEW: i64 = 3;
/// The topology store's view of the leases reaches the nodes this often.
const MEMBERSHIP_EVERY_MS: u64 = 250;
/// A process that lost its lease exits; its supervisor starts it again this long after.
const SUPERVISOR_RESTART_MS: u64 = 1_000;
/// A request for the lease that got no answer is given up after this long, and made again.
const JOIN_TIMEOUT_MS: u64 = 2_000;

/// What one run found.
#[derive(Debug, Clone)]
pub struct Report {
    pub scenario: &'static str,
    pub seed: u64,
    /// Broken invariants, in the order found (the first is the one that matters).
    pub violations: Vec<String>,
    /// The last steps before the first violation (when the run was traced).
    pub trace: Vec<String>,
    pub stats: Stats,
    /// What the director did, in a scenario that runs one to balance load.
    pub balance: Option<Balance>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "scenario {} seed {}: {}",
            self.scenario,
            self.seed,
            if self.ok() { "ok" } else { "FAILED" }
        )?;
        writeln!(f, "  {:?}", self.stats)?;
        if self.stats.bubbles.placements > 0 {
            writeln!(f, "  {}", self.stats.bubbles)?;
        }
        if let Some(b) = &self.balance {
            writeln!(f, "  {b}")?;
        }
        for v in self.violations.iter().take(10) {
            writeln!(f, "  violation: {v}")?;
        }
        if !self.trace.is_empty() {
            writeln!(f, "  last {} steps:", self.trace.len())?;
            for t in &self.trace {
                writeln!(f, "    {t}")?;
            }
        }
        Ok(())
    }
}

/// Figures of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub events: u64,
    pub handoffs: u64,
    pub inputs_sent: u64,
    pub inputs_delivered: u64,
    /// Inputs the cores dropped, each under a named reason.
    pub inputs_dropped: u64,
    pub input_drops: BTreeMap<&'static str, u64>,
    /// Inputs in frames lost with a broken link or a killed node (the network's loss).
    pub inputs_lost_in_network: u64,
    /// Inputs written to a game that crashed before it read them, or held by a process that
    /// was killed.
    pub inputs_lost_with_game: u64,
    pub inputs_applied: u64,
    /// Inputs games ignored: (for a frozen avatar, a repeat, no such avatar, an older session).
    pub inputs_ignored: (u64, u64, u64, u64),
    pub flaps: u64,
    pub entities_at_end: u64,
    /// Checkpoints the games answered and the nodes kept.
    pub checkpoints: u64,
    /// The same inputs as the nodes' and games' own counters tell them (what `up` reads).
    pub counted: Counted,
    pub commands: CommandFigures,
    pub trades: TradeFigures,
    pub dens: DenFigures,
    pub bubbles: BubbleFigures,
    /// Processes that exited for a lost lease.
    pub lease_exits: u64,
}

/// Dens (region-owned spawners) of one run, as the games, the census and the nodes count them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DenFigures {
    /// Den NPCs the games spawned on `SpawnerOwned`, and killed (then stocked again).
    pub stocked: u64,
    pub killed: u64,
    /// Dens a node gave up to another as the partition changed (`SpawnerReleased`).
    pub released: u64,
    /// Den NPCs that appeared while another of their den was held (must be 0).
    pub stocked_twice: u64,
}

impl DenFigures {
    pub fn add(&mut self, o: &DenFigures) {
        self.stocked += o.stocked;
        self.killed += o.killed;
        self.released += o.released;
        self.stocked_twice += o.stocked_twice;
    }
}

impl std::fmt::Display for DenFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dens stocked {}, killed {}, given up to another node {}; stocked twice {}",
            self.stocked, self.killed, self.released, self.stocked_twice
        )
    }
}

/// Trades under exclusive claims of one run, as the games, the census and the nodes count them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TradeFigures {
    /// Trades opened (both escrows asked), and of those with a partner on another node.
    pub started: u64,
    pub across_border: u64,
    /// Ended: gift applied, refused by a claim held elsewhere, failed, claim lost, called off.
    pub done: u64,
    pub refused: u64,
    pub failed: u64,
    pub lost: u64,
    pub called_off: u64,
    /// Claims the nodes granted, refused (held elsewhere), and lost (lease lapsed, fenced).
    pub claims_granted: u64,
    pub claims_refused: u64,
    pub claims_lost: u64,
    /// Claims carried by a handoff and rebound under the new epoch.
    pub claims_rebound: u64,
    /// Trades opened while one of their players was in another, by the census (must be 0).
    pub overlapping: u64,
}

impl TradeFigures {
    pub fn add(&mut self, o: &TradeFigures) {
        self.started += o.started;
        self.across_border += o.across_border;
        self.done += o.done;
        self.refused += o.refused;
        self.failed += o.failed;
        self.lost += o.lost;
        self.called_off += o.called_off;
        self.claims_granted += o.claims_granted;
        self.claims_refused += o.claims_refused;
        self.claims_lost += o.claims_lost;
        self.claims_rebound += o.claims_rebound;
        self.overlapping += o.overlapping;
    }
}

impl std::fmt::Display for TradeFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trades {} ({} across a border): done {}, refused {}, failed {}, lost {}, called off {}; \
             claims granted {}, refused {}, lost {}, rebound after a handoff {}; overlapping trades {}",
            self.started,
            self.across_border,
            self.done,
            self.refused,
            self.failed,
            self.lost,
            self.called_off,
            self.claims_granted,
            self.claims_refused,
            self.claims_lost,
            self.claims_rebound,
            self.overlapping
        )
    }
}

/// Entity commands of one run (the arena's combat), as the games and the census count them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommandFigures {
    /// Attacks and XP rewards the games sent.
    pub sent: u64,
    /// Of the attacks, those at an NPC another node simulated.
    pub across_border: u64,
    /// Commands the games applied, and those sent from another node.
    pub applied: u64,
    pub applied_from_other_nodes: u64,
    pub kills: u64,
    /// Results: ok, refused, entity gone, timeout, not delivered.
    pub results: (u64, u64, u64, u64, u64),
    /// Results for no request waiting: a second answer (must be 0).
    pub unexpected: u64,
    /// Commands applied twice, by the census of command ids (must be 0).
    pub applied_twice: u64,
    /// Requests of live games still without their answer at the end (must be 0).
    pub unanswered: u64,
    /// Commands the sidecars sent on following their target through a handoff.
    pub followed_handoffs: u64,
}

impl CommandFigures {
    pub fn add(&mut self, o: &CommandFigures) {
        self.sent += o.sent;
        self.across_border += o.across_border;
        self.applied += o.applied;
        self.applied_from_other_nodes += o.applied_from_other_nodes;
        self.kills += o.kills;
        self.results.0 += o.results.0;
        self.results.1 += o.results.1;
        self.results.2 += o.results.2;
        self.results.3 += o.results.3;
        self.results.4 += o.results.4;
        self.unexpected += o.unexpected;
        self.applied_twice += o.applied_twice;
        self.unanswered += o.unanswered;
        self.followed_handoffs += o.followed_handoffs;
    }
}

impl std::fmt::Display for CommandFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.results;
        write!(
            f,
            "commands sent {} ({} attacks across a border), applied {} ({} from another node), \
             kills {}, results ok/refused/gone/timeout/not delivered {}/{}/{}/{}/{}, \
             followed a handoff {}, applied twice {}, answered twice {}, unanswered {}",
            self.sent,
            self.across_border,
            self.applied,
            self.applied_from_other_nodes,
            self.kills,
            r.0,
            r.1,
            r.2,
            r.3,
            r.4,
            self.followed_handoffs,
            self.applied_twice,
            self.unexpected,
            self.unanswered
        )
    }
}

/// An input ledger from counters alone, as an operator reads it from metrics: no identity of
/// inputs, so a copy forwarded behind an offer and its original are told apart only by what
/// the nodes count of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    /// Inputs games read (applied or ignored).
    pub delivered: u64,
    /// Inputs the nodes dropped under a reason.
    pub dropped: u64,
    /// Forwarded inputs lost with a broken link, each copy counted.
    pub lost_forwards: u64,
    /// Inputs written to a game that crashed before it read them.
    pub lost_with_game: u64,
    /// Inputs a source applied after a refusal, whose copies also left.
    pub copies_applied: u64,
    /// Copies a target dropped because it refused the offer they followed.
    pub copies_refused: u64,
    /// Inputs a source did not apply again when its offer came back from a dead target, which
    /// had them (not in the sums: each is counted where it went).
    pub abandoned_with_target: u64,
    /// Inputs a game read after releasing the player's avatar and dropped, handed on: read
    /// twice (or read, then dropped under a reason), counted once.
    pub handed_on: u64,
}

impl Counted {
    /// Sent inputs the counters leave unexplained (negative: counted twice).
    pub fn unaccounted(&self, sent: u64) -> i64 {
        sent as i64 + self.copies_applied as i64 + self.handed_on as i64
            - self.copies_refused as i64
            - self.delivered as i64
            - self.dropped as i64
            - self.lost_forwards as i64
            - self.lost_with_game as i64
    }

    fn add(&mut self, o: Counted) {
        self.delivered += o.delivered;
        self.dropped += o.dropped;
        self.lost_forwards += o.lost_forwards;
        self.lost_with_game += o.lost_with_game;
        self.copies_applied += o.copies_applied;
        self.copies_refused += o.copies_refused;
        self.abandoned_with_target += o.abandoned_with_target;
        self.handed_on += o.handed_on;
    }
}

/// Where a core's link leads.
#[derive(Debug, Clone, Copy)]
enum Far {
    Peer(u64),
    /// A proxy's link (see `edge`).
    Proxy(u64),
}

/// A link between two nodes (one ordered stream each way).
struct PeerLink {
    a: NodeId,
    a_link: LinkId,
    b: NodeId,
    b_link: LinkId,
    /// Still carrying frames.
    up: bool,
    /// Broken (cut, or a node died): frames still in flight are lost.
    broken: bool,
    /// Arrival time of the last frame each way (TCP keeps order).
    last_ab: u64,
    last_ba: u64,
    in_flight_ab: usize,
    in_flight_ba: usize,
}

/// Inputs a game read: applied or ignored.
fn delivered_to(s: &ArenaStats) -> u64 {
    s.inputs_applied
        + s.inputs_while_frozen
        + s.inputs_duplicate
        + s.inputs_no_player
        + s.inputs_stale_session
}

struct Game {
    conn: ConnId,
    arena: Option<Arena>,
    /// The game reads nothing before this time (a long tick).
    busy_until: u64,
    /// Frames sent to the game and not read yet.
    in_flight: usize,
    /// Frames that arrived during a long tick, in order.
    backlog: VecDeque<SidecarFrame>,
    tick: u64,
}

impl Game {
    /// A game just started on connection `conn`: no arena until its Welcome.
    fn new(conn: ConnId) -> Self {
        Self {
            conn,
            arena: None,
            busy_until: 0,
            in_flight: 0,
            backlog: VecDeque::new(),
            tick: 0,
        }
    }
}

struct SimNode {
    id: NodeId,
    incarnation: u32,
    alive: bool,
    core: Option<Core>,
    game: Option<Game>,
    links: BTreeMap<LinkId, Far>,
    next_link: LinkId,
    timer_at: Option<u64>,
    dialling: BTreeSet<NodeId>,
    /// The process (its holder number) running as this node, or that last did, and the machine
    /// it runs on.
    holder: u64,
    machine: u64,
    /// The last grant that process held.
    lease: Option<Lease>,
    clock: Clock,
    /// A renewal of the lease is on its way, sent at this local time: given up after a lease
    /// (the store may never answer), as the real lease task's timeout does.
    renewing: Option<u64>,
    /// Processes waiting for the store to grant them this node id, by holder.
    pending: BTreeMap<u64, Pending>,
    /// Games started since the node did (a crashed game comes back under a new connection).
    game_generation: u32,
    /// When its current process started.
    started_at: u64,
}

/// A process of a node id that asks the store for the lease, and starts once granted.
struct Pending {
    clock: Clock,
    machine: u64,
    /// The grant (holder, epoch) it succeeds: a process restarted in place proves that its
    /// predecessor on this machine is gone (the sidecar's locked state file).
    successor_of: Option<(u64, u64)>,
    /// A request is on its way (requests go one at a time).
    asking: bool,
}

/// A lease request on its way to the store, or its answer on its way back.
#[derive(Debug, Clone)]
enum LeaseCall {
    Join,
    Renew(Lease),
}

#[derive(Debug)]
enum LeaseAnswer {
    Join(Answer),
    Renewed(Option<Lease>),
}

/// An ordered connection outside the mesh links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stream {
    ToGame(NodeId),
    FromGame(NodeId),
    ToClient(usize),
    FromClient(usize),
}

enum Ev {
    /// An input for a core (store answers, link events, game frames...).
    Core {
        node: NodeId,
        inc: u32,
        input: Input,
    },
    /// A frame over a peer link reaches `to`.
    PeerFrame {
        uid: u64,
        to: NodeId,
        frame: MeshFrame,
    },
    /// `to` notices the link is gone.
    PeerClosed {
        uid: u64,
        to: NodeId,
        reason: String,
    },
    /// A frame from the sidecar reaches the game (the one on connection `conn`).
    ToGame {
        node: NodeId,
        inc: u32,
        conn: ConnId,
        frame: SidecarFrame,
    },
    GameTick {
        node: NodeId,
        inc: u32,
        conn: ConnId,
    },
    /// A game that crashed starts again and connects to its sidecar.
    GameBack {
        node: NodeId,
        inc: u32,
    },
    GameWake {
        node: NodeId,
        inc: u32,
    },
    /// The topology store's word on who holds a lease reaches every node.
    Membership,
    /// A process's lease task: time to renew.
    LeaseTick {
        node: NodeId,
        inc: u32,
    },
    /// A lease request reaches the topology store.
    LeaseAtStore {
        node: NodeId,
        holder: u64,
        call: LeaseCall,
        sent_local: u64,
    },
    /// The store's answer reaches the process.
    LeaseReply {
        node: NodeId,
        holder: u64,
        sent_local: u64,
        answer: LeaseAnswer,
    },
    /// A process waiting for its node's lease asks (again).
    AskLease {
        node: NodeId,
        holder: u64,
    },
    /// A process that lost its lease exits.
    LeaseExit {
        node: NodeId,
        inc: u32,
    },
    Timer {
        node: NodeId,
        inc: u32,
    },
    /// An input for proxy `p`'s process `inc` (a client's, a board's answer).
    ProxyIn {
        p: usize,
        inc: u32,
        input: cellmesh_proxy::core::Input,
    },
    ProxyTimer {
        p: usize,
        inc: u32,
    },
    /// Proxy `p` dials its gateway `gateway`.
    ProxyDial {
        p: usize,
        inc: u32,
        gateway: cellmesh_proxy::core::GatewayId,
    },
    /// The gateway's hello on link `uid` reaches the proxy.
    ProxyLinkUp {
        uid: u64,
        hello: mesh::LinkHello,
    },
    /// A gateway's frame on link `uid` reaches the proxy.
    ProxyFrame {
        uid: u64,
        frame: MeshFrame,
    },
    /// The proxy notices link `uid` is gone.
    ProxyLinkDown {
        uid: u64,
        reason: String,
    },
    /// The gateway notices proxy link `uid` is gone.
    ProxyLinkClosedAtNode {
        uid: u64,
        node: NodeId,
        inc: u32,
        reason: String,
    },
    /// A new process of proxy `p` starts.
    ProxyBack {
        p: usize,
    },
    /// Frames of connection `conn` reach its client (then the connection closes: `close`).
    ToClient {
        client: usize,
        conn: u64,
        frames: Vec<bytes::Bytes>,
        close: bool,
    },
    ClientInput {
        client: usize,
        conn: u64,
    },
    /// A client logs in through its own geo's proxy.
    Login {
        client: usize,
    },
    /// A client connects to proxy `p` and logs in.
    ConnectTo {
        client: usize,
        p: usize,
    },
    Dial {
        from: NodeId,
        to: NodeId,
        inc: u32,
    },
    Fault(Fault),
    StoreUp,
    /// The director's core is due (its lease, a round).
    Director,
}

pub(crate) struct Sim<'a> {
    s: &'a Scenario,
    seed: u64,
    world: WorldShape,
    cfg: SidecarConfig,
    now: u64,
    rng: StdRng,
    /// The boards' probes of far clients draw from a stream of their own (from the same seed),
    /// so that answering them leaves every other draw of a run as it was.
    probe_rng: StdRng,
    queue: BTreeMap<(u64, u64), Ev>,
    seq: u64,
    nodes: Vec<SimNode>,
    clients: Vec<Client>,
    links: BTreeMap<u64, PeerLink>,
    next_uid: u64,
    cut: BTreeSet<(NodeId, NodeId)>,
    store: SimStore,
    leases: SimLeases,
    next_holder: u64,
    /// machine -> the topology store hears nothing from it before this time.
    store_cut: BTreeMap<u64, u64>,
    /// The topology store answers nothing before this time.
    topology_stall_until: u64,
    /// The live leases the nodes were last told of.
    last_live: Vec<(NodeId, u64)>,
    last_lapsed: Vec<(NodeId, u64)>,
    partition: Arc<Partition>,
    census: Arc<Census>,
    pub(crate) check: Checker,
    /// One proxy per geo with gateways, and the links to its gateways by uid.
    proxies: Vec<SimProxy>,
    proxy_links: BTreeMap<u64, ProxyLink>,
    /// (node, its end of a proxy link, session id) -> the client the proxy attached there.
    link_sessions: BTreeMap<(NodeId, LinkId, u64), usize>,
    account_client: BTreeMap<String, usize>,
    /// Every client connection (numbered across proxies) -> its client.
    conn_client: BTreeMap<u64, usize>,
    next_conn: u64,
    /// The geos' boards: (geo, account) -> the handover hint pinned there.
    hints: BTreeMap<(String, String), cellmesh_proto::cookie::HintCookie>,
    trace: Option<(usize, VecDeque<String>)>,
    streams: BTreeMap<Stream, u64>,
    /// An entity whose every change of holder is traced (`CELLMESH_SIM_WATCH`).
    watch: Option<u64>,
    pub(crate) stats: Stats,
    /// What killed nodes and their games had counted before they died.
    departed: Counted,
    /// What crashed games had counted.
    game_stats: Vec<ArenaStats>,
    /// Inputs the cores of killed nodes dropped, by reason.
    departed_drops: BTreeMap<&'static str, u64>,
    halted: bool,
    director: Option<Director>,
    /// Faults waiting for the gathering's move to start (see `FaultPlan`), and the source of
    /// that move once committed.
    during_gathering_move: Vec<(u64, Fault)>,
    gathering_source: Option<NodeId>,
}

fn ordered(a: NodeId, b: NodeId) -> (NodeId, NodeId) {
    (a.min(b), a.max(b))
}

impl<'a> Sim<'a> {
    pub fn new(s: &'a Scenario, seed: u64, trace_len: Option<usize>) -> Self {
        let world = WorldShape {
            width: s.world_m,
            height: s.world_m,
            chunk_size: s.chunk_m,
            region_size: s.world_m / f64::from(s.grid),
        };
        let layout = match s.layout {
            LayoutKind::Grid => {
                let owners = (0..s.grid * s.grid).map(|i| (i % s.nodes) + 1).collect();
                Layout::Grid(
                    Grid::new(&world, s.grid, s.grid, owners).expect("the scenario's grid"),
                )
            }
            LayoutKind::Bsp => {
                let nodes: Vec<NodeId> = (1..=s.nodes).collect();
                Layout::Bsp(Bsp::even(&world, &nodes).expect("the scenario's BSP"))
            }
        };
        let partition = Arc::new(Partition::new(world, 1, layout).expect("partition"));
        let mut cfg = SidecarConfig {
            world,
            link_outbox_frames: s.link_outbox_frames,
            game_outbox_frames: s.game_outbox_frames,
            attest_keys: vec![edge::ATTEST_KEY.into()],
            ..SidecarConfig::default()
        };
        if let Some(ms) = s.entity_cost_ms {
            cfg.load.entity_cost_ms = ms;
        }
        cfg.handoff_offload = s.zero_tick_handoffs;
        let mut sim = Self {
            s,
            seed,
            world,
            cfg,
            now: 0,
            rng: StdRng::seed_from_u64(seed),
            probe_rng: StdRng::seed_from_u64(seed ^ PROBE_STREAM),
            queue: BTreeMap::new(),
            seq: 0,
            nodes: Vec::new(),
            clients: (0..s.players)
                .map(|i| Client::new(format!("player-{i}")))
                .collect(),
            links: BTreeMap::new(),
            next_uid: 1,
            cut: BTreeSet::new(),
            store: SimStore::with_geos(
                s.geos
                    .map(|g| g.names.iter().map(|n| n.to_string()).collect())
                    .unwrap_or_default(),
            ),
            leases: SimLeases::default(),
            next_holder: 1,
            store_cut: BTreeMap::new(),
            topology_stall_until: 0,
            last_live: Vec::new(),
            last_lapsed: Vec::new(),
            partition,
            census: Arc::new(Census::default()),
            check: Checker::default(),
            proxies: edge::proxies_of(s),
            proxy_links: BTreeMap::new(),
            link_sessions: BTreeMap::new(),
            account_client: (0..s.players as usize)
                .map(|i| (format!("player-{i}"), i))
                .collect(),
            conn_client: BTreeMap::new(),
            next_conn: 1,
            hints: BTreeMap::new(),
            trace: trace_len.map(|n| (n, VecDeque::new())),
            streams: BTreeMap::new(),
            watch: trace_len.and_then(|_| std::env::var("CELLMESH_SIM_WATCH").ok()?.parse().ok()),
            stats: Stats::default(),
            departed: Counted::default(),
            game_stats: Vec::new(),
            departed_drops: BTreeMap::new(),
            halted: false,
            director: Director::of(s),
            during_gathering_move: Vec::new(),
            gathering_source: None,
        };
        for id in 1..=s.nodes {
            sim.nodes.push(SimNode {
                id,
                incarnation: 0,
                alive: false,
                core: None,
                game: None,
                links: BTreeMap::new(),
                next_link: 1,
                timer_at: None,
                dialling: BTreeSet::new(),
                holder: 0,
                machine: 0,
                lease: None,
                clock: Clock::default(),
                renewing: None,
                pending: BTreeMap::new(),
                game_generation: 0,
                started_at: 0,
            });
            sim.ask_lease(id, None);
        }
        sim.schedule(MEMBERSHIP_EVERY_MS, Ev::Membership);
        for p in 0..sim.proxies.len() {
            sim.start_proxy(p);
        }
        // The director starts a balance period into the run: its first round, as its lease is
        // granted, comes then.
        if let Some(d) = sim.director.as_mut() {
            let period = d.period_ms();
            d.wake_at = Some(period);
            sim.schedule(period, Ev::Director);
        }
        for c in 0..s.players as usize {
            let at = sim.rng.random_range(200..1_000);
            sim.schedule(at, Ev::Login { client: c });
            if let Some(g) = s.gathering.filter(|g| g.geo == s.client_geo(c)) {
                sim.clients[c].roams = Some((g.centre, g.side_m));
            }
        }
        let mut plan = FaultPlan::default();
        (s.faults)(s, &mut sim.rng, &mut plan);
        plan.at(s.motion_ms, Fault::Halt);
        for (at, f) in plan.faults {
            sim.schedule_at(at, Ev::Fault(f));
        }
        sim.during_gathering_move = plan.during_gathering_move;
        sim
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if let Some((cap, t)) = &mut self.trace {
            if t.len() == *cap {
                t.pop_front();
            }
            t.push_back(format!("{:>7} ms  {}", self.now, line()));
        }
    }

    /// The arrival time of something sent now on `stream` after `delay`: never before what was
    /// sent earlier on the same stream (a connection keeps order).
    fn fifo(&mut self, stream: Stream, delay: u64) -> u64 {
        let last = self.streams.entry(stream).or_insert(0);
        let at = (self.now + delay).max(*last);
        *last = at;
        at
    }

    fn schedule(&mut self, after_ms: u64, ev: Ev) {
        self.schedule_at(self.now + after_ms, ev);
    }

    fn schedule_at(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at.max(self.now), self.seq), ev);
    }

    /// The time as node `id`'s process reads it.
    fn time_of(&self, id: NodeId) -> Now {
        let c = &self.nodes[id as usize - 1].clock;
        Now {
            mono_ms: c.local(self.now),
            unix_ms: c.unix(self.now, START_UNIX_MS),
        }
    }

    fn node(&mut self, id: NodeId) -> &mut SimNode {
        &mut self.nodes[id as usize - 1]
    }

    // ------------------------------------------------------------------ the run

    /// Runs to the end; returns the trace of the last steps if it was kept.
    pub fn run(&mut self) -> Vec<String> {
        let end = self.s.motion_ms + self.s.settle_ms;
        while let Some(((at, _), ev)) = self.queue.pop_first() {
            if at > end {
                break;
            }
            self.now = at;
            self.stats.events += 1;
            self.step(ev);
            if !self.check.violations.is_empty() {
                break;
            }
        }
        if self.check.violations.is_empty() {
            self.now = end;
            self.final_checks();
        }
        self.trace
            .take()
            .map(|(_, t)| t.into_iter().collect())
            .unwrap_or_default()
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Core { node, inc, input } => {
                let link_gone = matches!(&input, Input::LinkFrame { link, .. }
                    if !self.nodes[node as usize - 1].links.contains_key(link));
                if self.live(node, inc) && !link_gone {
                    self.feed(node, input);
                } else if let Input::LinkFrame { messages, .. } = &input {
                    // A client's input on its way to a gateway that died, or over a proxy link
                    // that closed, is lost with it.
                    let Input::LinkFrame { link, .. } = &input else {
                        unreachable!("matched above")
                    };
                    for m in messages {
                        if let Some(mesh_message::Body::Input(i)) = &m.body {
                            self.proxy_input_lost(node, *link, i.session_id, i.seq);
                        }
                    }
                }
            }
            Ev::PeerFrame { uid, to, frame } => self.peer_frame(uid, to, frame),
            Ev::PeerClosed { uid, to, reason } => {
                let Some(l) = self.links.get(&uid) else {
                    return;
                };
                let link = if l.a == to { l.a_link } else { l.b_link };
                let other = if l.a == to { l.b } else { l.a };
                if self.nodes[to as usize - 1].links.remove(&link).is_some() {
                    self.note(|| format!("n{to} link {link} closed: {reason}"));
                    self.feed(to, Input::LinkClosed { link, reason });
                }
                // A dialler redials, with back-off, for as long as the core wants the peer.
                if self.nodes[to as usize - 1].dialling.contains(&other) {
                    let inc = self.nodes[to as usize - 1].incarnation;
                    let again = self.rng.random_range(100..400);
                    self.schedule(
                        again,
                        Ev::Dial {
                            from: to,
                            to: other,
                            inc,
                        },
                    );
                }
            }
            Ev::ToGame {
                node,
                inc,
                conn,
                frame,
            } => self.game_receives(node, inc, conn, frame),
            Ev::GameTick { node, inc, conn } => self.game_tick(node, inc, conn),
            Ev::GameBack { node, inc } => self.game_back(node, inc),
            Ev::GameWake { node, inc } => self.game_wake(node, inc),
            Ev::Timer { node, inc } => {
                if !self.live(node, inc) {
                    return;
                }
                let due = self.node(node).timer_at;
                if due.is_some_and(|t| t <= self.now) {
                    self.node(node).timer_at = None;
                    self.feed(node, Input::Timer);
                }
            }
            Ev::ProxyIn { p, inc, input } => self.proxy_in(p, inc, input),
            Ev::ProxyTimer { p, inc } => self.proxy_timer(p, inc),
            Ev::ProxyDial { p, inc, gateway } => self.proxy_dial(p, inc, gateway),
            Ev::ProxyLinkUp { uid, hello } => self.proxy_link_up(uid, hello),
            Ev::ProxyFrame { uid, frame } => self.proxy_frame(uid, frame),
            Ev::ProxyLinkDown { uid, reason } => self.proxy_link_down(uid, reason),
            Ev::ProxyLinkClosedAtNode {
                uid,
                node,
                inc,
                reason,
            } => self.proxy_link_closed_at_node(uid, node, inc, reason),
            Ev::ProxyBack { p } => self.start_proxy(p),
            Ev::ToClient {
                client,
                conn,
                frames,
                close,
            } => self.client_receives(client, conn, frames, close),
            Ev::ClientInput { client, conn } => self.client_input(client, conn),
            Ev::Login { client } => self.login(client),
            Ev::ConnectTo { client, p } => self.connect(client, p),
            Ev::Dial { from, to, inc } => self.dial(from, to, inc),
            Ev::Fault(f) => self.fault(f),
            Ev::StoreUp => {}
            Ev::Director => self.director_wake(),
            Ev::Membership => {
                self.membership(false);
                self.schedule(MEMBERSHIP_EVERY_MS, Ev::Membership);
            }
            Ev::LeaseTick { node, inc } => self.lease_tick(node, inc),
            Ev::LeaseAtStore {
                node,
                holder,
                call,
                sent_local,
            } => self.lease_at_store(node, holder, call, sent_local),
            Ev::LeaseReply {
                node,
                holder,
                sent_local,
                answer,
            } => self.lease_reply(node, holder, sent_local, answer),
            Ev::AskLease { node, holder } => self.send_join(node, holder),
            Ev::LeaseExit { node, inc } => {
                if self.live(node, inc) {
                    self.note(|| format!("n{node} exits: its lease was lost"));
                    self.kill(node);
                    self.schedule(SUPERVISOR_RESTART_MS, Ev::Fault(Fault::Restart(node)));
                }
            }
        }
    }

    fn live(&self, node: NodeId, inc: u32) -> bool {
        let n = &self.nodes[node as usize - 1];
        n.alive && n.incarnation == inc
    }

    // ------------------------------------------------------------------ nodes

    // ------------------------------------------------------------------ leases

    /// A new process of node `id` starts and asks the store for its lease: on the machine of
    /// its last process, as the successor of its grant `successor_of`, when restarted in place;
    /// on a machine of its own otherwise.
    fn ask_lease(&mut self, id: NodeId, successor_of: Option<(u64, u64)>) {
        let holder = self.next_holder;
        self.next_holder += 1;
        let machine = match successor_of {
            Some(_) => self.node(id).machine,
            None => holder,
        };
        let (slowest, fastest) = self.s.clock_ppm;
        let skew = self.s.clock_skew_ms as i64;
        let clock = Clock {
            base_true: self.now,
            base_local: self.rng.random_range(0..1_000_000),
            rate_ppm: if slowest < fastest {
                self.rng.random_range(slowest..=fastest)
            } else {
                slowest
            },
            unix_skew_ms: if skew > 0 {
                self.rng.random_range(-skew..=skew)
            } else {
                0
            },
        };
        self.note(|| format!("n{id} process {holder} starts ({clock:?})"));
        self.node(id).pending.insert(
            holder,
            Pending {
                clock,
                machine,
                successor_of,
                asking: false,
            },
        );
        self.send_join(id, holder);
    }

    fn send_join(&mut self, node: NodeId, holder: u64) {
        let now = self.now;
        let Some(p) = self.node(node).pending.get_mut(&holder) else {
            return;
        };
        if p.asking {
            return;
        }
        p.asking = true;
        let sent_local = p.clock.local(now);
        self.send_lease_call(node, holder, LeaseCall::Join, sent_local);
        // No answer (the store cannot hear it): the process tries again.
        self.schedule(JOIN_TIMEOUT_MS, Ev::AskLease { node, holder });
    }

    /// The machine process `holder` of node `node` runs on.
    fn machine_of(&self, node: NodeId, holder: u64) -> u64 {
        let n = &self.nodes[node as usize - 1];
        n.pending.get(&holder).map_or(n.machine, |p| p.machine)
    }

    fn cut_from_store(&self, node: NodeId, holder: u64) -> bool {
        let machine = self.machine_of(node, holder);
        self.store_cut.get(&machine).is_some_and(|&t| self.now < t)
    }

    fn send_lease_call(&mut self, node: NodeId, holder: u64, call: LeaseCall, sent_local: u64) {
        if self.cut_from_store(node, holder) {
            self.note(|| format!("n{node} process {holder}: lease request lost ({call:?})"));
            return;
        }
        let d = self.s.store_delay.draw(&mut self.rng);
        self.schedule(
            d,
            Ev::LeaseAtStore {
                node,
                holder,
                call,
                sent_local,
            },
        );
    }

    /// The topology store handles a lease request, by its own clock.
    fn lease_at_store(&mut self, node: NodeId, holder: u64, call: LeaseCall, sent_local: u64) {
        if self.now < self.topology_stall_until {
            let at = self.topology_stall_until;
            self.schedule_at(
                at,
                Ev::LeaseAtStore {
                    node,
                    holder,
                    call,
                    sent_local,
                },
            );
            return;
        }
        let (now, ttl) = (self.now, self.s.lease_ms);
        let answer = match call {
            LeaseCall::Join => {
                let Some(p) = self.nodes[node as usize - 1].pending.get(&holder) else {
                    return;
                };
                let successor_of = p.successor_of;
                LeaseAnswer::Join(self.leases.acquire(
                    now,
                    START_UNIX_MS,
                    node,
                    holder,
                    successor_of,
                    ttl,
                ))
            }
            LeaseCall::Renew(lease) => LeaseAnswer::Renewed(self.leases.reclaim(
                now,
                START_UNIX_MS,
                node,
                holder,
                lease.epoch,
                ttl,
            )),
        };
        self.note(|| format!("store: n{node} process {holder}: {answer:?}"));
        if self.cut_from_store(node, holder) {
            return;
        }
        let d = self.s.store_delay.draw(&mut self.rng);
        self.schedule(
            d,
            Ev::LeaseReply {
                node,
                holder,
                sent_local,
                answer,
            },
        );
    }

    fn lease_reply(&mut self, node: NodeId, holder: u64, sent_local: u64, answer: LeaseAnswer) {
        let writable = topology::writable_ms(self.s.lease_ms);
        match answer {
            LeaseAnswer::Join(answer) => {
                let Some(p) = self.node(node).pending.get_mut(&holder) else {
                    return;
                };
                p.asking = false;
                match answer {
                    Answer::Granted(lease) => {
                        let p = self.node(node).pending.remove(&holder).expect("above");
                        let until = sent_local + writable;
                        self.granted(node, holder, p.clock, p.machine, lease, until);
                    }
                    // Restarted in place, and the id went to another process meanwhile: this
                    // one exits ("another sidecar runs as this node").
                    Answer::Held { .. } if p.successor_of.is_some() => {
                        self.node(node).pending.remove(&holder);
                    }
                    // A process elsewhere asks again the moment the lease lapses (as fast as
                    // anyone could).
                    Answer::Held { until } => {
                        self.schedule_at(until, Ev::AskLease { node, holder });
                    }
                }
            }
            LeaseAnswer::Renewed(renewed) => {
                let n = self.node(node);
                if !n.alive || n.holder != holder {
                    return;
                }
                n.renewing = None;
                match renewed {
                    Some(lease) => {
                        n.lease = Some(lease.clone());
                        let terms = LeaseTerms {
                            lease,
                            until_ms: sent_local + writable,
                        };
                        self.feed(node, Input::LeaseRenewed(terms));
                    }
                    None => self.feed(node, Input::LeaseLost),
                }
            }
        }
    }

    /// The store granted node `id` to process `holder`: no other process of the id may still
    /// write. A process of the id still running exits (it lost its lease, or should have).
    fn granted(
        &mut self,
        id: NodeId,
        holder: u64,
        clock: Clock,
        machine: u64,
        lease: Lease,
        until: u64,
    ) {
        let now = self.now;
        let n = &self.nodes[id as usize - 1];
        if let Some(core) = n.core.as_ref().filter(|_| n.alive) {
            let local = n.clock.local(now);
            if core.writes_at(local) {
                let old = n.holder;
                self.check.violation(
                    now,
                    format!(
                        "two writers of node {id}: the store granted it to process {holder} \
                         (epoch {}) while process {old} may still write",
                        lease.epoch
                    ),
                );
            }
            self.kill(id);
        }
        self.node(id).machine = machine;
        self.start_node(id, holder, clock, lease, until);
    }

    /// The lease task of node `node`'s process: renew, one request at a time.
    fn lease_tick(&mut self, node: NodeId, inc: u32) {
        if !self.live(node, inc) {
            return;
        }
        let (now, every) = (self.now, topology::renew_every_ms(self.s.lease_ms));
        let lease_ms = self.s.lease_ms;
        let n = self.node(node);
        let local = n.clock.local(now);
        let next = n.clock.true_at(local + every);
        let waiting = n.renewing.is_some_and(|sent| local < sent + lease_ms);
        let call = (!waiting)
            .then(|| n.lease.clone())
            .flatten()
            .filter(|_| n.core.as_ref().is_some_and(|c| !c.lease_lost()));
        let holder = n.holder;
        if let Some(lease) = call {
            self.node(node).renewing = Some(local);
            self.send_lease_call(node, holder, LeaseCall::Renew(lease), local);
        }
        self.schedule_at(next, Ev::LeaseTick { node, inc });
    }

    // ------------------------------------------------------------------ nodes

    /// Process `holder` starts as node `id` under `lease`, writing until `until` (its clock)
    /// unless a renewal lands.
    fn start_node(&mut self, id: NodeId, holder: u64, clock: Clock, lease: Lease, until: u64) {
        let mut cfg = self.cfg.clone();
        cfg.node_id = id;
        cfg.geo = self.s.geo_name(id).into();
        // Each geo has its own claim store; a key's home geo is one of the run's geos.
        cfg.geos = self
            .s
            .geos
            .map(|g| g.names.iter().map(|n| n.to_string()).collect())
            .unwrap_or_default();
        // The first geo is the core: it restores a geo none of whose nodes lives.
        if cfg.geos.len() > 1 {
            cfg.core_geo = cfg.geos[0].clone();
        }
        self.node(id).clock = clock;
        let now = self.time_of(id);
        self.note(|| {
            format!(
                "n{id} process {holder} runs under lease epoch {}",
                lease.epoch
            )
        });
        let core = Core::new(
            Arc::new(cfg),
            cellmesh_sidecar::metrics::Metrics::default(),
            self.partition.clone(),
            true,
            Some(LeaseTerms {
                lease: lease.clone(),
                until_ms: until,
            }),
            now,
        );
        let started_at = self.now;
        let n = self.node(id);
        n.incarnation += 1;
        n.alive = true;
        n.core = Some(core);
        n.links.clear();
        n.dialling.clear();
        n.timer_at = None;
        n.holder = holder;
        n.lease = Some(lease);
        n.renewing = None;
        let inc = n.incarnation;
        n.game_generation = 0;
        n.started_at = started_at;
        let conn = u64::from(inc) << 16;
        n.game = Some(Game::new(conn));
        // The lease task renews at once, then every `renew_every_ms`.
        self.schedule(0, Ev::LeaseTick { node: id, inc });
        // The game, then membership: who else is alive, under which lease. Proxies dial it
        // themselves.
        self.connect_game(id, conn);
        let first_tick = self.rng.random_range(0..self.s.tick_ms);
        self.schedule(
            first_tick,
            Ev::GameTick {
                node: id,
                inc,
                conn,
            },
        );
        self.membership(true);
    }

    /// The game on connection `conn` says Hello to its sidecar.
    fn connect_game(&mut self, id: NodeId, conn: ConnId) {
        let hello = local::Hello {
            version: Some(local::ProtocolVersion::current()),
            tick_rate_hz: (1000 / self.s.tick_ms.max(1)) as u32,
            game: "sim-arena".into(),
        };
        self.feed(
            id,
            Input::GameHello {
                conn,
                hello,
                rest: vec![],
            },
        );
    }

    /// Tells every live core who its live peers are and their lease epochs (what the topology
    /// store's membership task reports): when the store's leases changed, or `always`.
    fn membership(&mut self, always: bool) {
        // A stalled store answers no membership read.
        if self.now < self.topology_stall_until {
            return;
        }
        // A dead process's lease stays until it lapses.
        let live = self.leases.live(self.now);
        let lapsed = self.leases.lapsed(self.now);
        if !always && (&live, &lapsed) == (&self.last_live, &self.last_lapsed) {
            return;
        }
        self.last_live = live.clone();
        self.last_lapsed = lapsed.clone();
        let alive: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .map(|n| n.id)
            .collect();
        for &id in &alive {
            let peers: Vec<PeerInfo> = live
                .iter()
                .filter(|(n, _)| *n != id)
                .map(|(n, _)| PeerInfo {
                    node: *n,
                    mesh_addr: format!("node-{n}"),
                    geo: self.s.geo_name(*n).into(),
                })
                .collect();
            let others =
                |l: &[(NodeId, u64)]| l.iter().filter(|(n, _)| *n != id).copied().collect();
            self.feed(
                id,
                Input::PeerLeases {
                    live: others(&live),
                    lapsed: others(&lapsed),
                },
            );
            self.feed(id, Input::Peers(peers));
        }
    }

    /// A partition committed to the store: each live node reads it at its own membership tick.
    fn publish_partition(&mut self, p: Partition) {
        self.partition = Arc::new(p);
        let ids: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .map(|n| n.id)
            .collect();
        for id in ids {
            let d = self.rng.random_range(0..500);
            let inc = self.node(id).incarnation;
            self.schedule(
                d,
                Ev::Core {
                    node: id,
                    inc,
                    input: Input::Partition(Box::new((*self.partition).clone())),
                },
            );
        }
    }

    /// Entities spawned in game frames still on their way to a sidecar (`from(node, inc, conn)`)
    /// that will never read them: gone with the process or game that sent them.
    fn spawns_in_flight_lost(
        &mut self,
        from: impl Fn(NodeId, u32, ConnId) -> bool,
        holder: NodeId,
    ) {
        let lost: Vec<u64> = self
            .queue
            .values()
            .filter_map(|ev| match ev {
                Ev::Core {
                    node,
                    inc,
                    input: Input::GameFrame { conn, messages },
                } if from(*node, *inc, *conn) => Some(messages),
                _ => None,
            })
            .flatten()
            .filter_map(|m| match &m.body {
                Some(game_message::Body::Spawn(s)) => Some(s.entity_id),
                _ => None,
            })
            .collect();
        for id in lost {
            self.census.despawned(id, holder);
        }
    }

    fn kill(&mut self, id: NodeId) {
        if !self.node(id).alive {
            return;
        }
        self.note(|| format!("n{id} KILLED"));
        if self.s.bubbles.is_some() {
            self.stats.bubbles.kills += 1;
            if self.sum_over_cores(|c| c.handoffs_in_flight() as u64) > 0 {
                self.stats.bubbles.kills_mid_handoff += 1;
            }
        }
        // What its core and game counted goes with them: kept for the final ledgers.
        let counted = self.counted_by(id);
        self.departed.add(counted);
        if let Some(c) = self.nodes[id as usize - 1].core.as_ref() {
            // Inputs it held that no other node has a copy of die with it.
            let dead: BTreeSet<NodeId> = self
                .nodes
                .iter()
                .filter(|n| !n.alive)
                .map(|n| n.id)
                .collect();
            let held = c.inputs_only_here_if(|n| dead.contains(&n));
            self.check.inputs_lost_with_node(held);
            // Spawned too late for their first checkpoint to reach the store: gone with it, as
            // if their spawn had been lost.
            for e in c.unpersisted() {
                self.census.despawned(e, id);
            }
            for reason in cellmesh_sidecar::metrics::INPUT_DROP_REASONS {
                let n = c.metrics().inputs_dropped_for(reason);
                if n > 0 {
                    *self.departed_drops.entry(reason).or_default() += n;
                }
            }
        }
        // Spawned in a frame its sidecar never read: lost the same way.
        let inc = self.node(id).incarnation;
        self.spawns_in_flight_lost(|node, i, _| node == id && i == inc, id);
        let n = self.node(id);
        if let Some(g) = n.game.take() {
            for frame in &g.backlog {
                self.check.frame_lost_with_game(frame);
            }
            self.check.game_gone(id);
            self.game_stats
                .push(g.arena.map(|a| a.stats).unwrap_or_default());
        }
        let n = self.node(id);
        n.alive = false;
        n.core = None;
        n.links.clear();
        self.check.node_gone(id);
        self.census.release_holder(id);
        // Its lease goes, and its report with it.
        if let Some(d) = self.director.as_mut() {
            d.reports.remove(&id);
        }
        // Its links break; peers notice soon after.
        let uids: Vec<u64> = self
            .links
            .iter()
            .filter(|(_, l)| l.up && (l.a == id || l.b == id))
            .map(|(u, _)| *u)
            .collect();
        for uid in uids {
            self.break_link(uid, "the peer died", 50);
        }
        // Its proxies' links break too: the proxies move its sessions to other gateways.
        let uids: Vec<u64> = self
            .proxy_links
            .iter()
            .filter(|(_, l)| l.up && l.node() == id)
            .map(|(u, _)| *u)
            .collect();
        for uid in uids {
            self.break_proxy_link(uid, "the gateway died", 50);
        }
    }

    /// Hands an input to a core, then carries out what it asks for.
    fn feed(&mut self, id: NodeId, input: Input) {
        let now = self.time_of(id);
        if self.trace.is_some() {
            let d = describe_input(&input);
            self.note(|| format!("n{id} <- {d}"));
        }
        let watch = self.watch;
        if self.node(id).core.is_none() {
            return;
        }
        if let Input::GameFrame { messages, .. } = &input {
            self.check.frame_from_game(id, messages);
        }
        let core = self.node(id).core.as_mut().expect("checked above");
        // Who writes the watched entity here, under which epoch, and in which chunk.
        let watched = |core: &Core, e: u64| {
            core.entities()
                .get(e)
                .map(|e| (e.origin(), e.epoch, (e.chunk.x, e.chunk.y)))
        };
        let before = watch.map(|e| watched(core, e));
        core.handle(now, input);
        // An entity whose game crashed before its first checkpoint came back is gone, as if
        // its spawn had been lost with the crash.
        for gone in core.take_unrestorable() {
            self.census.despawned(gone, id);
        }
        let core = self.node(id).core.as_mut().expect("handled above");
        if let (Some(e), Some(before)) = (watch, before) {
            let after = watched(core, e);
            if after != before {
                self.note(|| format!("WATCH n{id}: e{e} {before:?} -> {after:?}"));
            }
        }
        self.drain(id);
        self.gathering_move_started(id);
        let (now, node) = (self.now, &self.nodes[(id - 1) as usize]);
        if let Some(core) = node.core.as_ref() {
            self.check.after_step(now, id, core);
            let believed = core
                .claims_believed(node.clock.local(now))
                .into_iter()
                .map(|(key, entity, until)| (key, entity, node.clock.true_at(until)))
                .collect();
            self.check.claims_after_step(now, id, believed);
        }
    }

    fn drain(&mut self, id: NodeId) {
        loop {
            let Some(core) = self.node(id).core.as_mut() else {
                return;
            };
            let Some(out) = core.poll_output() else {
                break;
            };
            self.act(id, out);
        }
        let inc = self.node(id).incarnation;
        let clock = self.node(id).clock;
        // The core's deadlines are on its own clock.
        let next = self
            .node(id)
            .core
            .as_ref()
            .and_then(|c| c.poll_timeout())
            .map(|t| clock.true_at(t));
        if let Some(t) = next {
            let n = self.node(id);
            if n.timer_at.is_none_or(|at| t < at) {
                n.timer_at = Some(t);
                self.schedule_at(t, Ev::Timer { node: id, inc });
            }
        }
    }

    fn act(&mut self, id: NodeId, out: Output) {
        let inc = self.node(id).incarnation;
        match out {
            Output::ToGame { conn, frame } => {
                let Some(g) = self.node(id).game.as_mut().filter(|g| g.conn == conn) else {
                    return;
                };
                g.in_flight += 1;
                let full = g.in_flight > self.s.game_outbox_frames;
                if full {
                    self.node(id).game = None;
                    self.note(|| format!("n{id} game outbox full"));
                    self.feed(id, Input::GameStalled { conn });
                    return;
                }
                self.check.frame_to_game(self.now, id, &frame);
                if self.trace.is_some() {
                    let d = describe_to_game(&frame);
                    if !d.is_empty() {
                        self.note(|| format!("n{id} -> game: {d}"));
                    }
                }
                let d = LOCAL_DELAY.draw(&mut self.rng);
                let at = self.fifo(Stream::ToGame(id), d);
                self.schedule_at(
                    at,
                    Ev::ToGame {
                        node: id,
                        inc,
                        conn,
                        frame,
                    },
                );
            }
            Output::GameFatal { .. } | Output::KillGame { .. } | Output::ReleaseGame { .. } => {
                self.node(id).game = None;
            }
            Output::ToLink { link, frame } => self.send_on_link(id, link, frame),
            Output::KillLink { link } | Output::ReleaseLink { link } => {
                match self.node(id).links.remove(&link) {
                    Some(Far::Peer(uid)) => self.break_link(uid, "closed by the peer", 0),
                    Some(Far::Proxy(uid)) => self.node_closes_proxy_link(uid),
                    None => {}
                }
            }
            Output::Dial { node, .. } => {
                self.node(id).dialling.insert(node);
                let d = self.rng.random_range(0..50);
                self.schedule(
                    d,
                    Ev::Dial {
                        from: id,
                        to: node,
                        inc,
                    },
                );
            }
            Output::StopDial { node } => {
                self.node(id).dialling.remove(&node);
            }
            Output::Store(StoreRequest::CommitPartition { partition }) => {
                let epoch = partition.epoch();
                let result = if self.now < self.store.down_until {
                    Err("no answer within 5 s".to_string())
                } else if epoch == self.partition.epoch() + 1 {
                    self.note(|| format!("n{id} commits partition {epoch}"));
                    self.publish_partition(*partition);
                    Ok(())
                } else {
                    Err(format!("the store is at epoch {}", self.partition.epoch()))
                };
                let d = self.s.store_delay.draw(&mut self.rng) * 2;
                self.schedule(
                    d,
                    Ev::Core {
                        node: id,
                        inc,
                        input: Input::Store(StoreReply::PartitionCommitted { epoch, result }),
                    },
                );
            }
            Output::Store(StoreRequest::FenceLease { node, epoch }) => {
                let holder = self.node(id).holder;
                let result =
                    if self.now < self.topology_stall_until || self.cut_from_store(id, holder) {
                        Err("no answer within 5 s".to_string())
                    } else {
                        let fence = self.leases.fence(self.now, node, epoch);
                        self.note(|| format!("n{id} fences n{node} epoch {epoch}: {fence:?}"));
                        Ok(fence)
                    };
                let d = self.s.store_delay.draw(&mut self.rng) * 2;
                self.schedule(
                    d,
                    Ev::Core {
                        node: id,
                        inc,
                        input: Input::Store(StoreReply::LeaseFenced {
                            node,
                            epoch,
                            result,
                        }),
                    },
                );
            }
            Output::Store(req) => {
                // A machine cut from the store reaches none of its claims either.
                let holder = self.node(id).holder;
                let cut = self.cut_from_store(id, holder);
                let geo = self.s.geo_of(id);
                let (reply, extra) = self.store.execute(self.now, req, cut, geo);
                if let Some(reply) = reply {
                    let d = self.s.store_delay.draw(&mut self.rng) * 2 + extra;
                    self.schedule(
                        d,
                        Ev::Core {
                            node: id,
                            inc,
                            input: Input::Store(reply),
                        },
                    );
                }
            }
            Output::LoadReport(report) => self.load_report(id, *report),
            Output::Players(players) => self.players_report(id, players),
            Output::Ready(_) | Output::Publish => {}
            Output::Stop => self.kill(id),
            // The process exits (right after this step); its supervisor starts it again.
            Output::Exit { reason } => {
                self.stats.lease_exits += 1;
                if self.s.no_lease_exits {
                    self.check
                        .violation(self.now, format!("n{id} exited: {reason}"));
                }
                let inc = self.node(id).incarnation;
                self.schedule(0, Ev::LeaseExit { node: id, inc });
            }
        }
    }

    // ------------------------------------------------------------------ peer links

    fn dial(&mut self, from: NodeId, to: NodeId, inc: u32) {
        if !self.live(from, inc) || !self.node(from).dialling.contains(&to) {
            return;
        }
        let pair = ordered(from, to);
        let connected = self
            .links
            .values()
            .any(|l| l.up && ordered(l.a, l.b) == pair);
        if connected {
            return;
        }
        if self.cut.contains(&pair) || !self.node(to).alive {
            let again = self.rng.random_range(100..1_000);
            self.schedule(again, Ev::Dial { from, to, inc });
            return;
        }
        let delay = self.s.mesh_delay_of(from, to).draw(&mut self.rng);
        let uid = self.next_uid;
        self.next_uid += 1;
        let a_link = self.new_link(from, uid);
        let b_link = self.new_link(to, uid);
        self.links.insert(
            uid,
            PeerLink {
                a: from,
                a_link,
                b: to,
                b_link,
                up: true,
                broken: false,
                last_ab: self.now + 2 * delay,
                last_ba: self.now + 2 * delay,
                in_flight_ab: 0,
                in_flight_ba: 0,
            },
        );
        let epoch = self.partition.epoch();
        let lease_epochs: BTreeMap<NodeId, u64> = [from, to]
            .into_iter()
            .map(|n| (n, self.node(n).lease.as_ref().map_or(0, |l| l.epoch)))
            .collect();
        let hello = |node: NodeId| mesh::LinkHello {
            version: Some(mesh::ProtocolVersion::current()),
            role: PeerRole::Sidecar as i32,
            id: node.to_string(),
            geo: self.s.geo_name(node).into(),
            partition_epoch: epoch,
            node_id: node,
            lease_epoch: lease_epochs[&node],
            // The list of homes is compared by the driver's handshake, not in the core.
            ..Default::default()
        };
        let inc_to = self.node(to).incarnation;
        // The accepting side hears the dialler's hello first; the dialler gets the answer a
        // round trip after it dialled.
        self.schedule(
            delay,
            Ev::Core {
                node: to,
                inc: inc_to,
                input: Input::LinkUp {
                    link: b_link,
                    hello: hello(from),
                    remote: format!("node-{from}"),
                    rest: vec![],
                },
            },
        );
        self.schedule(
            2 * delay,
            Ev::Core {
                node: from,
                inc,
                input: Input::LinkUp {
                    link: a_link,
                    hello: hello(to),
                    remote: format!("node-{to}"),
                    rest: vec![],
                },
            },
        );
    }

    fn new_link(&mut self, node: NodeId, uid: u64) -> LinkId {
        let n = self.node(node);
        let link = n.next_link;
        n.next_link += 1;
        n.links.insert(link, Far::Peer(uid));
        link
    }

    fn send_on_link(&mut self, id: NodeId, link: LinkId, frame: MeshFrame) {
        match self.node(id).links.get(&link).copied() {
            Some(Far::Proxy(uid)) => self.gateway_sends(uid, frame),
            Some(Far::Peer(uid)) => {
                let Some(l) = self.links.get_mut(&uid) else {
                    return;
                };
                if !l.up {
                    self.check.lost_in_network(&frame.messages);
                    return;
                }
                let (to, ab) = if l.a == id { (l.b, true) } else { (l.a, false) };
                let d = self.s.mesh_delay_of(id, to).draw(&mut self.rng);
                let (last, in_flight) = if ab {
                    (&mut l.last_ab, &mut l.in_flight_ab)
                } else {
                    (&mut l.last_ba, &mut l.in_flight_ba)
                };
                *in_flight += 1;
                let full = *in_flight > self.s.link_outbox_frames;
                let at = (self.now + d).max(*last);
                *last = at;
                if full {
                    // The outbox filled: the driver cuts the link and tells the core.
                    self.check.lost_in_network(&frame.messages);
                    self.node(id).links.remove(&link);
                    self.break_link(uid, "outbox full", 0);
                    self.feed(id, Input::LinkStalled { link });
                    return;
                }
                self.check.frame_between(id, to, &frame);
                self.schedule_at(at, Ev::PeerFrame { uid, to, frame });
            }
            None => {}
        }
    }

    fn peer_frame(&mut self, uid: u64, to: NodeId, frame: MeshFrame) {
        let Some(l) = self.links.get_mut(&uid) else {
            return;
        };
        let ab = l.b == to;
        if ab {
            l.in_flight_ab = l.in_flight_ab.saturating_sub(1);
        } else {
            l.in_flight_ba = l.in_flight_ba.saturating_sub(1);
        }
        if l.broken {
            self.check.lost_in_network(&frame.messages);
            return;
        }
        let link = if ab { l.b_link } else { l.a_link };
        if !self.nodes[to as usize - 1].links.contains_key(&link) {
            // Closed at this end already: what still arrives is refused.
            self.check.lost_in_network(&frame.messages);
            return;
        }
        self.feed(
            to,
            Input::LinkFrame {
                link,
                messages: frame.messages,
            },
        );
    }

    /// The link stops: each end that still has it hears it closed after `detect_ms` (plus the
    /// way's delay); with `detect_ms` > 0 it broke, and what is in flight is lost.
    fn break_link(&mut self, uid: u64, reason: &str, detect_ms: u64) {
        let Some(l) = self.links.get_mut(&uid) else {
            return;
        };
        if !l.up {
            return;
        }
        l.up = false;
        if detect_ms > 0 {
            l.broken = true;
        }
        let (a, b, la, lb) = (l.a, l.b, l.a_link, l.b_link);
        for (node, link, other) in [(a, la, b), (b, lb, a)] {
            if !self.nodes[node as usize - 1].links.contains_key(&link) {
                continue;
            }
            let d = self.s.mesh_delay_of(node, other).draw(&mut self.rng) + detect_ms;
            // After every frame already on its way (TCP closes in order).
            let last = {
                let l = &self.links[&uid];
                if node == l.b {
                    l.last_ab
                } else {
                    l.last_ba
                }
            };
            let at = (self.now + d).max(last);
            self.schedule_at(
                at,
                Ev::PeerClosed {
                    uid,
                    to: node,
                    reason: reason.to_string(),
                },
            );
        }
    }

    // ------------------------------------------------------------------ the game

    fn game_receives(&mut self, node: NodeId, inc: u32, conn: ConnId, frame: SidecarFrame) {
        if !self.live(node, inc) {
            // Written to a game killed with its node.
            self.check.frame_lost_with_game(&frame);
            return;
        }
        let now = self.now;
        let Some(g) = self.node(node).game.as_mut().filter(|g| g.conn == conn) else {
            // Written to a game that crashed meanwhile.
            self.check.frame_lost_with_game(&frame);
            return;
        };
        if g.busy_until > now || !g.backlog.is_empty() {
            // A long tick: the game reads this, in order, when it is done.
            g.backlog.push_back(frame);
            let at = g.busy_until;
            self.schedule_at(at, Ev::GameWake { node, inc });
            return;
        }
        self.game_reads(node, inc, frame);
    }

    /// The game is done with a long tick: it reads what queued up meanwhile.
    fn game_wake(&mut self, node: NodeId, inc: u32) {
        if !self.live(node, inc) {
            return;
        }
        loop {
            let now = self.now;
            let Some(g) = self.node(node).game.as_mut() else {
                return;
            };
            if g.busy_until > now {
                let at = g.busy_until;
                self.schedule_at(at, Ev::GameWake { node, inc });
                return;
            }
            let Some(frame) = g.backlog.pop_front() else {
                return;
            };
            self.game_reads(node, inc, frame);
        }
    }

    fn game_reads(&mut self, node: NodeId, inc: u32, frame: SidecarFrame) {
        let mut out: Vec<game_message::Body> = Vec::new();
        let seed = self.seed;
        let s = self.s;
        let census = self.census.clone();
        let halted = self.halted;
        let g = self.node(node).game.as_mut().expect("checked above");
        g.in_flight = g.in_flight.saturating_sub(1);
        for m in frame.messages {
            let Some(body) = m.body else { continue };
            match (&mut g.arena, body) {
                (None, sidecar_message::Body::Welcome(w)) => {
                    let c = s.world_m / f64::from(s.grid);
                    // Every arena's NPCs roam around a corner shared by four regions, unless
                    // the scenario gathers them somewhere.
                    let (center, spread) = s.npc_area.unwrap_or(((c, c), c));
                    let cfg = ArenaConfig {
                        npcs: s.npcs_per_node,
                        center,
                        spread,
                        tick_hz: (1000 / s.tick_ms.max(1)) as u32,
                        seed: seed ^ (u64::from(node) << 32) ^ u64::from(inc),
                        player_speed: s.player_speed,
                        npc_speed: s.npc_speed,
                        census: Some(census.clone()),
                        // Both ways of handing over, side by side: games of even nodes release
                        // what walks out, the others wait for the sidecar's Freeze.
                        release: node.is_multiple_of(2),
                        release_avatars: s.zero_tick_handoffs,
                        combat: s.combat,
                        trade: s.trade,
                        dens: s.dens.iter().map(|(k, at)| (k.to_string(), *at)).collect(),
                        ..ArenaConfig::default()
                    };
                    let mut arena = Arena::new(cfg, &w);
                    arena.start(&mut out);
                    g.arena = Some(arena);
                }
                (Some(arena), body) => arena.on_message(&mut out, body),
                (None, _) => {}
            }
        }
        let conn = g.conn;
        if halted {
            if let Some(a) = g.arena.as_mut() {
                a.halt();
            }
        }
        if !out.is_empty() {
            let d = LOCAL_DELAY.draw(&mut self.rng);
            self.send_from_game(node, inc, conn, out, d);
        }
    }

    /// The game's messages reach its sidecar `delay` ms from now, in order.
    fn send_from_game(
        &mut self,
        node: NodeId,
        inc: u32,
        conn: ConnId,
        out: Vec<game_message::Body>,
        delay: u64,
    ) {
        let at = self.fifo(Stream::FromGame(node), delay);
        let messages = out.into_iter().map(GameMessage::from).collect();
        self.schedule_at(
            at,
            Ev::Core {
                node,
                inc,
                input: Input::GameFrame { conn, messages },
            },
        );
    }

    fn game_tick(&mut self, node: NodeId, inc: u32, conn: ConnId) {
        if !self.live(node, inc) {
            return;
        }
        if self.node(node).game.as_ref().is_none_or(|g| g.conn != conn) {
            // The game this tick belonged to crashed.
            return;
        }
        let slow = self.s.slow_tick_every > 0 && self.rng.random_ratio(1, self.s.slow_tick_every);
        let extra = if slow { self.s.slow_tick_ms } else { 0 };
        let dt = self.s.tick_ms as f64 / 1000.0;
        let halted = self.halted;
        let now = self.now;
        let Some(g) = self.node(node).game.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        if let Some(arena) = g.arena.as_mut() {
            if halted {
                arena.halt();
            }
            g.tick += 1;
            arena.tick(&mut out, dt);
            arena.request_ids(&mut out);
            out.push(game_message::Body::TickEnd(local::TickEnd { tick: g.tick }));
        }
        g.busy_until = g.busy_until.max(now + extra);
        let conn = g.conn;
        let next = self.s.tick_ms + extra;
        if !out.is_empty() {
            // The tick's batch leaves when the tick is done.
            self.send_from_game(node, inc, conn, out, extra);
        }
        self.schedule(next, Ev::GameTick { node, inc, conn });
    }

    /// The game crashes: its state is lost and its connection closes; it comes back after
    /// `down_ms`.
    fn crash_game(&mut self, node: NodeId, down_ms: u64) {
        if !self.node(node).alive {
            return;
        }
        let Some(g) = self.node(node).game.take() else {
            return;
        };
        self.note(|| format!("n{node} GAME CRASHED for {down_ms} ms"));
        for frame in &g.backlog {
            self.check.frame_lost_with_game(frame);
        }
        self.check.game_gone(node);
        // Its frames on the way reach a sidecar that no longer reads that connection.
        let conn = g.conn;
        self.spawns_in_flight_lost(|n, _, c| n == node && c == conn, node);
        self.census.release_holder(node);
        self.departed.add(Counted {
            delivered: g.arena.as_ref().map_or(0, |a| delivered_to(&a.stats)),
            ..Counted::default()
        });
        self.game_stats
            .push(g.arena.map(|a| a.stats).unwrap_or_default());
        self.feed(
            node,
            Input::GameClosed {
                conn: g.conn,
                reason: "crashed".into(),
            },
        );
        let inc = self.node(node).incarnation;
        self.schedule(down_ms, Ev::GameBack { node, inc });
    }

    fn game_back(&mut self, node: NodeId, inc: u32) {
        if !self.live(node, inc) || self.node(node).game.is_some() {
            return;
        }
        let n = self.node(node);
        n.game_generation += 1;
        let conn = (u64::from(inc) << 16) | u64::from(n.game_generation);
        n.game = Some(Game::new(conn));
        self.note(|| format!("n{node} game back"));
        self.connect_game(node, conn);
        let first_tick = self.rng.random_range(0..self.s.tick_ms);
        self.schedule(first_tick, Ev::GameTick { node, inc, conn });
    }

    // ------------------------------------------------------------------ clients

    /// Where every entity held by a live game is. One its owner despawned is gone, even while an
    /// old owner still holds it frozen, waiting to be told to evict it.
    fn truth(&self) -> BTreeMap<u64, (f64, f64)> {
        let mut t = BTreeMap::new();
        for n in &self.nodes {
            let Some(a) = n.game.as_ref().and_then(|g| g.arena.as_ref()) else {
                continue;
            };
            for h in a.held() {
                if !self.census.is_despawned(h.id) {
                    t.insert(h.id, h.pos);
                }
            }
        }
        t
    }

    // ------------------------------------------------------------------ faults

    fn fault(&mut self, f: Fault) {
        self.note(|| format!("FAULT {f:?}"));
        match f {
            Fault::Cut { a, b, detect_ms } => {
                let pair = ordered(a, b);
                self.cut.insert(pair);
                let uids: Vec<u64> = self
                    .links
                    .iter()
                    .filter(|(_, l)| l.up && ordered(l.a, l.b) == pair)
                    .map(|(u, _)| *u)
                    .collect();
                for uid in uids {
                    self.break_link(uid, "the link broke", detect_ms.max(1));
                }
            }
            Fault::Restore { a, b } => {
                self.cut.remove(&ordered(a, b));
            }
            Fault::Kill(n) => self.kill(n),
            Fault::Restart(n) => {
                // Restarted in place: the successor of the last process's grant.
                let node = self.node(n);
                if !node.alive && node.pending.values().all(|p| p.successor_of.is_none()) {
                    let previous = node.lease.as_ref().map(|l| (node.holder, l.epoch));
                    self.ask_lease(n, previous);
                }
            }
            Fault::StoreCut { node, ms } => {
                let until = self.now + ms;
                let machine = self.node(node).machine;
                let t = self.store_cut.entry(machine).or_default();
                *t = (*t).max(until);
            }
            Fault::TopologyStall { ms } => {
                self.topology_stall_until = self.topology_stall_until.max(self.now + ms);
            }
            Fault::Contender(n) => self.ask_lease(n, None),
            Fault::Replan(owners) => {
                let epoch = self.partition.epoch() + 1;
                let grid = Grid::new(&self.world, self.s.grid, self.s.grid, owners).expect("grid");
                let p = Partition::new(self.world, epoch, Layout::Grid(grid)).expect("plan");
                self.publish_partition(p);
            }
            Fault::Relogin { client } => {
                if client < self.clients.len() {
                    // A new connection to the same proxy; the old one stays open until the
                    // gateway displaces its session.
                    let p = self.clients[client].proxy;
                    self.connect(client, p);
                }
            }
            Fault::Handover { client } => self.hand_over(client),
            Fault::ProxyRestart { geo, down_ms } => {
                if let Some(p) = self.proxies.iter().position(|x| x.geo == geo) {
                    self.proxy_restart(p, down_ms);
                }
            }
            Fault::StoreOutage { ms } => {
                self.store.down_until = self.now + ms;
                self.schedule(ms, Ev::StoreUp);
            }
            Fault::GameRestart { node, down_ms } => self.crash_game(node, down_ms),
            Fault::GameStall { node, ms } => {
                let now = self.now;
                if let Some(g) = self.node(node).game.as_mut() {
                    g.busy_until = g.busy_until.max(now + ms);
                }
            }
            Fault::Tripwire => self.check.violation(self.now, "the tripwire".to_string()),
            Fault::Halt => {
                self.halted = true;
                for c in &mut self.clients {
                    c.halted = true;
                }
                for n in &mut self.nodes {
                    if let Some(a) = n.game.as_mut().and_then(|g| g.arena.as_mut()) {
                        a.halt();
                    }
                }
            }
        }
    }

    // ------------------------------------------------------------------ the director

    /// A node's load report reaches the director (through the topology store, where a node
    /// publishes it under its lease: a process that may no longer write publishes nothing).
    fn load_report(&mut self, id: NodeId, report: cellmesh_world::balance::CellReport) {
        let writes = self.writes_now(id);
        if let (Some(d), true) = (self.director.as_mut(), writes) {
            d.reports.insert(id, report);
        }
    }

    /// Unfrozen reals of each node owning a cell (a frozen one is on its way to another node).
    fn reals_per_cell(&self) -> Vec<(NodeId, usize)> {
        self.partition
            .nodes()
            .into_iter()
            .map(|id| {
                let n = self.nodes[id as usize - 1]
                    .core
                    .as_ref()
                    .map_or(0, |c| c.reals().iter().filter(|r| !r.frozen).count());
                (id, n)
            })
            .collect()
    }

    /// The director's core is due: it is woken, its store calls answered at once, and woken
    /// again when it asks. The director stops with motion: the quiet end sees every handoff done.
    fn director_wake(&mut self) {
        let Some(d) = self.director.as_mut() else {
            return;
        };
        d.wake_at = None;
        if self.halted {
            return;
        }
        let mut input = cellmesh_director::Input::Timer;
        loop {
            let now = self.director_now();
            let Some(d) = self.director.as_mut() else {
                return;
            };
            d.core.handle(now, input);
            let outputs: Vec<_> = std::iter::from_fn(|| d.core.poll_output()).collect();
            let mut asked = None;
            for output in outputs {
                match output {
                    cellmesh_director::Output::Store(request) => asked = Some(request),
                    cellmesh_director::Output::Event(e) => self.director_saw(e),
                    cellmesh_director::Output::Ready(_) | cellmesh_director::Output::Stopped => {}
                }
            }
            let Some(request) = asked else {
                break;
            };
            input = cellmesh_director::Input::Store(self.director_call(request));
        }
        let now = self.now;
        let Some(d) = self.director.as_mut() else {
            return;
        };
        if let Some(at) = d.core.poll_timeout().map(|at| at.max(now)) {
            if d.wake_at != Some(at) {
                d.wake_at = Some(at);
                self.schedule_at(at, Ev::Director);
            }
        }
    }

    /// The director's clocks: it runs on the store's true time, from the start of the run.
    fn director_now(&self) -> cellmesh_director::Now {
        cellmesh_director::Now {
            mono: std::time::Duration::from_millis(self.now),
            unix_ms: START_UNIX_MS + self.now,
        }
    }

    fn director_saw(&mut self, event: cellmesh_director::Event) {
        use cellmesh_director::Event;
        match &event {
            Event::Committed {
                epoch,
                chunks_moved,
                ..
            } => {
                let (epoch, chunks_moved) = (*epoch, *chunks_moved);
                self.note(|| {
                    format!("director commits partition {epoch}: {chunks_moved} chunks move")
                });
            }
            Event::Placed { players, .. } => {
                let b = &mut self.stats.bubbles;
                b.placements += 1;
                b.most_placed = b.most_placed.max(*players as u64);
            }
            Event::RegionsCommitted { epoch, moves, .. } => {
                let epoch = *epoch;
                if self.trace.is_some() {
                    let m: Vec<String> = moves
                        .iter()
                        .map(|m| format!("{:?} n{} -> n{}", m.region, m.from, m.to))
                        .collect();
                    self.note(|| format!("director commits partition {epoch}: {}", m.join(", ")));
                }
                if let Some(d) = self.director.as_ref() {
                    let (b, stats) = (&mut self.stats.bubbles, d.core.stats());
                    b.bubble_moves = stats.bubble_moves;
                    b.regions_moved = stats.regions_moved;
                }
                self.gathering_moved(moves);
            }
            _ => {}
        }
        let now = self.now;
        if let Some(d) = self.director.as_mut() {
            d.observe(now, event);
        }
    }

    /// A commit moved regions: if the gathering's went to its players' geo for the first time,
    /// the faults waiting for that are due.
    fn gathering_moved(&mut self, moves: &[cellmesh_world::bubbles::RegionMove]) {
        let Some(g) = self.s.gathering else {
            return;
        };
        let region = self.region_of(g.centre);
        for m in moves.iter().filter(|m| m.region == region) {
            let b = &mut self.stats.bubbles;
            b.gathering_moves += 1;
            if self.s.geo_of(m.to) == g.geo && b.moved_at_ms.is_none() {
                b.moved_at_ms = Some(self.now);
                self.gathering_source = Some(m.from);
            }
        }
    }

    /// Once the source of the gathering's move hands entities off, the faults waiting for it
    /// are due.
    fn gathering_move_started(&mut self, id: NodeId) {
        if self.gathering_source != Some(id) {
            return;
        }
        let started = self.nodes[id as usize - 1]
            .core
            .as_ref()
            .is_some_and(|c| c.handoffs_in_flight() > 0);
        if started {
            self.gathering_source = None;
            self.note(|| format!("n{id} starts handing the gathering's region off"));
            for (after, f) in std::mem::take(&mut self.during_gathering_move) {
                self.schedule(after, Ev::Fault(f));
            }
        }
    }

    /// The grid region (column, row) holding the point `at` (metres).
    fn region_of(&self, at: (f64, f64)) -> (u32, u32) {
        let p = self
            .world
            .normalise(cellmesh_world::geometry::Pos { x: at.0, y: at.1 });
        let side = self.world.region_size;
        ((p.x / side) as u32, (p.y / side) as u32)
    }

    /// The topology store answers one of the director's calls. It answers nothing while the
    /// stores are out or stalled: the call fails.
    fn director_call(
        &mut self,
        request: cellmesh_director::StoreRequest,
    ) -> cellmesh_director::StoreReply {
        use cellmesh_director::{StoreReply, StoreRequest};
        // A balance round reads the store: how even the nodes are is sampled then, before it
        // decides.
        if matches!(request, StoreRequest::Read { .. }) && self.s.bubbles.is_none() {
            self.balance_sample();
        }
        let unix_ms = START_UNIX_MS + self.now;
        let out = self.now < self.store.down_until || self.now < self.topology_stall_until;
        let unanswered = || {
            topology::TopologyError::Store(cellmesh_stores::StoreError::Unavailable(
                "no answer within 5 s".into(),
            ))
        };
        let Some(d) = self.director.as_mut() else {
            unreachable!("a call from no director")
        };
        match request {
            _ if out => match request {
                StoreRequest::Acquire { .. } => StoreReply::Acquired(Err(unanswered())),
                StoreRequest::Renew { .. } => StoreReply::Renewed(Err(unanswered())),
                StoreRequest::Read { .. } => StoreReply::Read(Err(unanswered())),
                StoreRequest::Commit { .. } => StoreReply::Committed(Err(unanswered())),
                StoreRequest::Release { .. } => StoreReply::Released(Err(unanswered())),
            },
            StoreRequest::Acquire { holder, ttl } => {
                StoreReply::Acquired(Ok(d.acquire(unix_ms, &holder, ttl)))
            }
            StoreRequest::Renew { lease, ttl } => {
                StoreReply::Renewed(Ok(d.renew(unix_ms, &lease, ttl)))
            }
            StoreRequest::Release { lease } => StoreReply::Released(Ok(d.release(unix_ms, &lease))),
            StoreRequest::Read { .. } => {
                let loads = self.director_loads();
                let world = cellmesh_director::WorldRead {
                    partition: Some((*self.partition).clone()),
                    loads,
                    nodes: self.node_entries(),
                    players: self.director_players(),
                };
                StoreReply::Read(Ok(Box::new(world)))
            }
            StoreRequest::Commit {
                lease,
                expected_epoch,
                next,
            } => StoreReply::Committed(Ok(self.director_commit(&lease, expected_epoch, *next))),
        }
    }

    /// The store's `commit_partition_as`: the epoch compared and the lease checked in one step,
    /// then published to the nodes as any re-plan.
    fn director_commit(
        &mut self,
        lease: &cellmesh_stores::topology::DirectorLease,
        expected_epoch: u64,
        next: Partition,
    ) -> topology::Commit {
        let current_epoch = self.partition.epoch();
        if current_epoch != expected_epoch || next.epoch() != expected_epoch + 1 {
            return topology::Commit::Stale { current_epoch };
        }
        let unix_ms = START_UNIX_MS + self.now;
        if let Some(d) = self.director.as_mut() {
            if let Err(director) = d.fence(unix_ms, lease) {
                return topology::Commit::Fenced { director };
            }
        }
        self.publish_partition(next);
        topology::Commit::Committed
    }

    /// A node's players reach the director the same way.
    fn players_report(
        &mut self,
        id: NodeId,
        players: Vec<cellmesh_stores::topology::PlayerSample>,
    ) {
        let writes = self.writes_now(id);
        if let (Some(d), true) = (self.director.as_mut(), writes) {
            d.players.insert(id, players);
        }
    }

    /// Whether node `id`'s process may write now, by its own clock.
    fn writes_now(&self, id: NodeId) -> bool {
        let local = self.nodes[id as usize - 1].clock.local(self.now);
        self.nodes[id as usize - 1]
            .core
            .as_ref()
            .is_some_and(|c| c.writes_at(local))
    }

    /// The nodes whose lease is live now.
    fn live_nodes(&self) -> BTreeSet<NodeId> {
        self.leases
            .live(self.now)
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    /// The players of the nodes whose lease is live, as the store's `players`.
    fn director_players(&self) -> BTreeMap<NodeId, Vec<cellmesh_stores::topology::PlayerSample>> {
        let live = self.live_nodes();
        self.director.as_ref().map_or_else(BTreeMap::new, |d| {
            d.players
                .iter()
                .filter(|(n, _)| live.contains(n))
                .map(|(n, p)| (*n, p.clone()))
                .collect()
        })
    }

    /// The load reports of the nodes whose lease is live, as the store's `loads`.
    fn director_loads(&self) -> BTreeMap<NodeId, cellmesh_world::balance::CellReport> {
        let live = self.live_nodes();
        self.director
            .as_ref()
            .map(|d| {
                d.reports
                    .iter()
                    .filter(|(n, _)| live.contains(n))
                    .map(|(n, r)| (*n, r.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The store's `nodes` as the director reads them: each live grant whose process holds it,
    /// with the record it publishes as soon as it does.
    fn node_entries(&self) -> Vec<topology::NodeEntry> {
        self.leases
            .live(self.now)
            .into_iter()
            .filter_map(|(id, epoch)| {
                let lease = self.nodes[id as usize - 1]
                    .lease
                    .clone()
                    .filter(|l| l.epoch == epoch)?;
                Some(topology::NodeEntry {
                    lease,
                    live: true,
                    record: Some(topology::NodeRecord {
                        node: id,
                        geo: self.s.geo_name(id).into(),
                        mesh_addr: format!("n{id}"),
                        admin_addr: format!("n{id}"),
                    }),
                })
            })
            .collect()
    }

    /// How even the nodes are as a round starts: their reals, and the loads they reported.
    fn balance_sample(&mut self) {
        let entities = self.reals_per_cell();
        let now = self.now;
        let Some(d) = self.director.as_mut() else {
            return;
        };
        d.figures.rounds += 1;
        let loads: Vec<f64> = entities
            .iter()
            .map(|(n, _)| d.reports.get(n).map_or(0.0, |r| r.load))
            .collect();
        d.figures.samples.push(Sample {
            at_ms: now,
            max_over_avg: max_over_avg(entities.iter().map(|(_, n)| *n as f64)),
            reported_max_over_avg: max_over_avg(loads),
            entities,
        });
    }

    // ------------------------------------------------------------------ the end

    /// Every live core.
    fn cores(&self) -> impl Iterator<Item = (NodeId, &Core)> {
        self.nodes
            .iter()
            .filter_map(|n| Some((n.id, n.core.as_ref()?)))
    }

    /// One node's (and its game's) input counters.
    fn counted_by(&self, id: NodeId) -> Counted {
        let n = &self.nodes[id as usize - 1];
        let delivered = n
            .game
            .as_ref()
            .and_then(|g| g.arena.as_ref())
            .map_or(0, |a| delivered_to(&a.stats));
        let Some(c) = n.core.as_ref() else {
            return Counted {
                delivered,
                ..Counted::default()
            };
        };
        let m = c.metrics();
        Counted {
            delivered,
            dropped: m.inputs_dropped_total(),
            lost_forwards: 0,
            lost_with_game: 0,
            copies_applied: m.inputs_copies_applied.get(),
            copies_refused: m.inputs_copies_refused.get(),
            abandoned_with_target: m.inputs_abandoned_with_target.get(),
            handed_on: m.inputs_handed_on.get(),
        }
    }

    fn sum_over_cores(&self, f: impl Fn(&Core) -> u64) -> u64 {
        self.cores().map(|(_, c)| f(c)).sum()
    }

    /// Every command applied at most once, every request answered exactly once.
    fn command_checks(&mut self, games: &[ArenaStats]) {
        let f = &mut self.stats.commands;
        for s in games {
            f.sent += s.attacks_sent + s.xp_sent;
            f.across_border += s.attacks_across_border;
            f.applied += s.attacks_applied + s.xp_applied;
            f.applied_from_other_nodes +=
                s.attacks_applied_from_other_nodes + s.xp_from_other_nodes;
            f.kills += s.kills;
            f.results.0 += s.results_ok;
            f.results.1 += s.results_refused;
            f.results.2 += s.results_entity_gone;
            f.results.3 += s.results_timeout;
            f.results.4 += s.results_not_delivered;
            f.unexpected += s.results_unexpected;
        }
        f.applied_twice = self.census.commands().1;
        f.unanswered = self
            .nodes
            .iter()
            .filter_map(|n| n.game.as_ref()?.arena.as_ref())
            .map(|a| a.commands_outstanding() as u64)
            .sum();
        let f = *f;
        self.stats.commands.followed_handoffs = self.sum_over_cores(|c| {
            c.metrics()
                .commands_forwarded
                .get_or_create(&cellmesh_sidecar::metrics::WhyLabel { why: "handoff" })
                .get()
        });
        if f.applied_twice > 0 {
            self.check.violation(
                self.now,
                format!("{} commands were applied twice", f.applied_twice),
            );
        }
        if f.unexpected > 0 {
            self.check.violation(
                self.now,
                format!(
                    "{} results came for no request waiting (answered twice?)",
                    f.unexpected
                ),
            );
        }
        if f.unanswered > 0 {
            self.check.violation(
                self.now,
                format!("{} requests have no answer at the end", f.unanswered),
            );
        }
    }

    /// No player in two trades at once (the claims' promise, as the games saw it).
    fn trade_checks(&mut self, games: &[ArenaStats]) {
        let t = &mut self.stats.trades;
        for s in games {
            t.started += s.trades_started;
            t.across_border += s.trades_across_border;
            t.done += s.trades_done;
            t.refused += s.trades_refused;
            t.failed += s.trades_failed;
            t.lost += s.trades_lost;
            t.called_off += s.trades_called_off;
        }
        t.overlapping = self.census.trades().1;
        let claims = |c: &Core, r: &'static str| c.metrics().claims_for(r);
        self.stats.trades.claims_granted = self.sum_over_cores(|c| claims(c, "granted"));
        self.stats.trades.claims_refused = self.sum_over_cores(|c| claims(c, "held"));
        self.stats.trades.claims_rebound =
            self.sum_over_cores(|c| c.metrics().claims_rebound.get());
        self.stats.trades.claims_lost = self.sum_over_cores(|c| {
            ["lapsed", "fenced", "lapsed_in_handoff"]
                .iter()
                .map(|r| {
                    c.metrics()
                        .claims_lost
                        .get_or_create(&cellmesh_sidecar::metrics::ReasonLabel { reason: r })
                        .get()
                })
                .sum()
        });
        let overlapping = self.stats.trades.overlapping;
        if overlapping > 0 {
            self.check.violation(
                self.now,
                format!("{overlapping} trades opened while a player was in another"),
            );
        }
    }

    /// No den stocked twice at once (the spawners' promise, as the census saw it).
    fn den_checks(&mut self, games: &[ArenaStats]) {
        let d = &mut self.stats.dens;
        for s in games {
            d.killed += s.den_kills;
            d.released += s.dens_released;
        }
        (d.stocked, d.stocked_twice) = self.census.dens();
        let twice = d.stocked_twice;
        if twice > 0 {
            self.check.violation(
                self.now,
                format!("{twice} den NPCs appeared while their den had another"),
            );
        }
    }

    fn final_checks(&mut self) {
        self.inputs_left_in_proxies();
        // Every entity is checkpointed within an interval of its last change (a game busy with
        // a long tick answers late: the slack covers one).
        let slack = self.s.slow_tick_ms + 500;
        let missing: Vec<String> = self
            .cores()
            .flat_map(|(id, c)| {
                c.checkpoints_missing(slack)
                    .into_iter()
                    .map(move |e| format!("n{id} e{e}"))
            })
            .take(8)
            .collect();
        if !missing.is_empty() {
            self.check.violation(
                self.now,
                format!(
                    "reals without the checkpoint they are due: {}",
                    missing.join(", ")
                ),
            );
        }
        let report = self.census.report();
        let cores: Vec<(NodeId, Vec<cellmesh_sidecar::Real>)> =
            self.cores().map(|(id, c)| (id, c.reals())).collect();
        let in_flight = self.sum_over_cores(|c| c.handoffs_in_flight() as u64);
        let held = self.sum_over_cores(|c| c.held_frames() as u64);
        if held > 0 {
            let detail: Vec<String> = self
                .cores()
                .flat_map(|(id, c)| {
                    c.held_detail().into_iter().map(move |h| {
                        format!(
                            "n{id} holds {} for e{} ep{} (follows {:?})",
                            h.frames, h.entity, h.waits_for, h.follows
                        )
                    })
                })
                .take(8)
                .collect();
            self.check
                .violation(self.now, format!("held: {}", detail.join("; ")));
        }
        // A node the partition gives no region has handed everything away.
        let owning = self.partition.nodes();
        for (id, reals) in &cores {
            if !owning.contains(id) && !reals.is_empty() {
                let ids: Vec<u64> = reals.iter().map(|r| r.id).take(8).collect();
                self.check.violation(
                    self.now,
                    format!(
                        "n{id} owns no region but still holds {} reals, e.g. {ids:?}",
                        reals.len()
                    ),
                );
            }
        }
        self.stats.entities_at_end = report.alive.len() as u64;
        self.stats.flaps = self.clients.iter().map(|c| c.flaps).sum();
        // Every game that ran: the live ones and those that crashed.
        let games: Vec<ArenaStats> = self
            .nodes
            .iter()
            .filter_map(|n| n.game.as_ref()?.arena.as_ref())
            .map(|a| a.stats.clone())
            .chain(self.game_stats.iter().cloned())
            .collect();
        self.stats.inputs_applied = games.iter().map(|s| s.inputs_applied).sum();
        for s in &games {
            let i = &mut self.stats.inputs_ignored;
            i.0 += s.inputs_while_frozen;
            i.1 += s.inputs_duplicate;
            i.2 += s.inputs_no_player;
            i.3 += s.inputs_stale_session;
        }
        // What the cores counted, the killed ones' included.
        let dropped = self.sum_over_cores(|c| c.metrics().inputs_dropped_total());
        self.stats.inputs_dropped = dropped + self.departed.dropped;
        for reason in cellmesh_sidecar::metrics::INPUT_DROP_REASONS {
            let n = self.sum_over_cores(|c| c.metrics().inputs_dropped_for(reason))
                + self.departed_drops.get(reason).copied().unwrap_or(0);
            if n > 0 {
                self.stats.input_drops.insert(reason, n);
            }
        }
        self.stats.inputs_delivered = self.check.delivered();
        self.stats.inputs_lost_in_network = self.check.lost();
        let mut counted = self.departed;
        for n in 1..=self.s.nodes {
            counted.add(self.counted_by(n));
        }
        counted.lost_forwards = self.check.lost_forwards();
        counted.lost_with_game = self.check.lost_with_game();
        self.stats.inputs_lost_with_game = self.check.lost_with_game();
        self.stats.counted = counted;
        self.stats.handoffs = self.sum_over_cores(|c| c.metrics().handoffs_out.get());
        self.command_checks(&games);
        self.trade_checks(&games);
        self.den_checks(&games);
        self.stats.checkpoints = self.sum_over_cores(|c| c.metrics().checkpoints.get());
        self.gathering_checks();
        // One avatar per account, whatever its sessions did.
        for c in &self.clients {
            let holders: Vec<(NodeId, u64)> = self
                .nodes
                .iter()
                .filter_map(|n| {
                    let id = n.game.as_ref()?.arena.as_ref()?.avatar_of(&c.account)?;
                    Some((n.id, id))
                })
                .collect();
            let ids: BTreeSet<u64> = holders.iter().map(|h| h.1).collect();
            if ids.len() > 1 {
                self.check.violation(
                    self.now,
                    format!("{} has {} avatars: {holders:?}", c.account, ids.len()),
                );
            }
            if ids.is_empty() && !c.ended && c.epoch.is_some() {
                self.check.violation(
                    self.now,
                    format!(
                        "{} has a session on n{} and no avatar in any game",
                        c.account, c.gateway
                    ),
                );
            }
        }
        let stats = self.stats.clone();
        self.check
            .at_quiescence(self.now, &report, &cores, in_flight, held, &stats);
        if self.director.is_some() {
            let end = max_over_avg(self.reals_per_cell().into_iter().map(|(_, n)| n as f64));
            if let Some(d) = self.director.as_mut() {
                d.figures.end_max_over_avg = end;
            }
        }
    }

    /// Where the gathering ended. The director moved its region to its players' geo, and their
    /// avatars are simulated there at the end, if that geo has had a live node long enough
    /// before motion stopped for the policy to move the bubble back after a fallback (the
    /// dwell, the sustained gain, a few evaluations and a lease's lapse). If the geo has no live
    /// node at the end, the bubble fell back: they are in the core. If its node came back too
    /// late to tell, they are wherever the director's last placement put their bubble. In every
    /// case the director's last placement must agree.
    fn gathering_checks(&mut self) {
        let (Some(g), Some(p), Some(d)) = (
            self.s.gathering,
            self.s.bubbles.as_ref(),
            self.director.as_ref(),
        ) else {
            return;
        };
        let stats = d.core.stats();
        let centre = cellmesh_world::geometry::Pos {
            x: g.centre.0,
            y: g.centre.1,
        };
        // The bubble of the gathering: the largest one over its centre.
        let placed = stats
            .bubbles
            .iter()
            .filter(|b| self.world.distance(b.area.centre, centre) <= b.area.radius_m)
            .max_by_key(|b| b.members.len())
            .map(|b| usize::from(b.site.0));
        let name = |geo: Option<usize>| geo.map_or("nowhere", |geo| self.s.geo_label(geo));
        if self.stats.bubbles.moved_at_ms.is_none() {
            let why = format!(
                "the gathering's region never moved to {}: at most {} players placed in {} \
                 rounds, the last placement puts it in {}",
                self.s.geo_label(g.geo),
                self.stats.bubbles.most_placed,
                self.stats.bubbles.placements,
                name(placed)
            );
            return self.check.violation(self.now, why);
        }
        let back_for = p.dwell_ms + p.sustain_ms + 3 * p.evaluate_every_ms + self.s.lease_ms;
        let up_since = self
            .nodes
            .iter()
            .filter(|n| n.alive && self.s.geo_of(n.id) == g.geo)
            .map(|n| n.started_at)
            .min();
        let expected = match up_since {
            None => Some(0),
            Some(t) if t + back_for <= self.s.motion_ms => Some(g.geo),
            Some(_) => placed,
        };
        if placed != expected {
            let why = format!(
                "the director's last placement puts the gathering in {} where {} is due",
                name(placed),
                name(expected)
            );
            return self.check.violation(self.now, why);
        }
        let Some(expected) = expected else {
            return self
                .check
                .violation(self.now, "the gathering is in no bubble".to_string());
        };
        let mut wrong = Vec::new();
        for c in (0..self.clients.len()).filter(|&c| self.s.client_geo(c) == g.geo) {
            let account = &self.clients[c].account;
            let holder = self.nodes.iter().find(|n| {
                n.game
                    .as_ref()
                    .and_then(|game| game.arena.as_ref())
                    .and_then(|a| a.avatar_of(account))
                    .is_some()
            });
            match holder {
                Some(n) if self.s.geo_of(n.id) == expected => {}
                Some(n) => wrong.push(format!(
                    "{account} on n{} in {}",
                    n.id,
                    self.s.geo_name(n.id)
                )),
                None => wrong.push(format!("{account} has no avatar")),
            }
        }
        if !wrong.is_empty() {
            let why = format!(
                "the gathering is due in {}, but {}",
                self.s.geo_label(expected),
                wrong.join(", ")
            );
            return self.check.violation(self.now, why);
        }
        self.stats.bubbles.ended_in = Some(self.s.geo_label(expected));
    }
}

fn describe_input(input: &Input) -> String {
    match input {
        Input::LinkFrame { link, messages } => {
            let names: Vec<String> = messages.iter().map(describe_mesh).collect();
            format!("link {link}: {}", names.join(", "))
        }
        Input::GameFrame { messages, .. } => {
            let names: Vec<String> = messages
                .iter()
                .filter_map(|m| m.body.as_ref())
                .filter(|b| {
                    !matches!(
                        b,
                        game_message::Body::Update(_) | game_message::Body::TickEnd(_)
                    )
                })
                .map(|b| match b {
                    game_message::Body::Release(r) => format!(
                        "Release(e{} ep{} after #{} s{})",
                        r.entity_id, r.entity_epoch, r.last_input_seq, r.input_session_epoch
                    ),
                    b => format!("{b:?}").chars().take(120).collect(),
                })
                .collect();
            format!("game: {} (+ updates)", names.join(", "))
        }
        Input::Timer => "timer".into(),
        Input::Store(r) => format!("store {:?}", r).chars().take(160).collect(),
        other => format!("{other:?}").chars().take(160).collect(),
    }
}

fn describe_to_game(frame: &SidecarFrame) -> String {
    use sidecar_message::Body as B;
    let parts: Vec<String> = frame
        .messages
        .iter()
        .filter_map(|m| match m.body.as_ref()? {
            B::Input(i) => Some(format!(
                "Input({} #{} s{})",
                i.account, i.seq, i.session_epoch
            )),
            B::Freeze(f) => Some(format!("Freeze(e{} ep{})", f.entity_id, f.entity_epoch)),
            B::Offload(o) => Some(format!("Offload(e{} ep{})", o.entity_id, o.entity_epoch)),
            B::Thaw(t) => Some(format!("Thaw(e{})", t.entity_id)),
            B::Evict(e) => Some(format!("Evict(e{})", e.entity_id)),
            B::Adopt(a) => Some(format!("Adopt(e{} ep{})", a.entity_id, a.entity_epoch)),
            B::PlayerJoin(j) => Some(format!("Join({} s{})", j.account, j.session_epoch)),
            B::PlayerLeave(l) => Some(format!("Leave({} s{})", l.account, l.session_epoch)),
            B::Error(e) => Some(format!("Error({})", e.detail)),
            _ => None,
        })
        .collect();
    parts.join(", ")
}

fn describe_mesh(m: &MeshMessage) -> String {
    use mesh_message::Body as B;
    match &m.body {
        Some(B::EntityState(s)) => format!(
            "State(e{} ep{}{})",
            s.entity_id,
            s.entity_epoch,
            if s.full { " full" } else { "" }
        ),
        Some(B::EntityGone(g)) => format!("Gone(e{} ep{})", g.entity_id, g.entity_epoch),
        Some(B::EntityMoved(m)) => format!(
            "Moved(e{} ep{} to n{})",
            m.entity_id, m.entity_epoch, m.owner_node
        ),
        Some(B::HandoffOffer(o)) => format!("Offer(e{} ep{})", o.entity_id, o.entity_epoch),
        Some(B::HandoffAck(a)) => format!("Ack(e{} ep{})", a.entity_id, a.entity_epoch),
        Some(B::HandoffRefused(r)) => {
            format!(
                "Refused(e{} ep{}: {})",
                r.entity_id, r.entity_epoch, r.reason
            )
        }
        Some(B::ForwardInput(i)) => format!("Fwd({} #{} ep{})", i.account, i.seq, i.entity_epoch),
        Some(B::Input(i)) => format!("Input(s{} #{})", i.session_id, i.seq),
        Some(B::Subscribe(s)) => format!("Sub({} chunks)", s.chunks.len()),
        Some(B::Unsubscribe(s)) => format!("Unsub({} chunks)", s.chunks.len()),
        Some(B::Anchor(a)) => {
            let p = a.position.unwrap_or_default();
            format!(
                "Anchor({} e{} ep{} at ({:.0}, {:.0}))",
                a.account, a.entity_id, a.entity_epoch, p.x, p.y
            )
        }
        Some(other) => format!("{other:?}").chars().take(80).collect(),
        None => "?".into(),
    }
}

/// Runs `scenario` with `seed`. A failed run is run again with a trace of its last steps (the
/// same seed gives the same run), which the report carries.
pub fn run(scenario: &Scenario, seed: u64) -> Report {
    let first = run_traced(scenario, seed, None);
    if first.ok() {
        return first;
    }
    let mut again = run_traced(scenario, seed, Some(60));
    if again.violations != first.violations {
        again.violations.push(format!(
            "the run is not reproducible: the first run found {:?}",
            first.violations.first()
        ));
    }
    again
}

/// Runs `scenario` with `seed`, keeping the last `trace_len` steps if asked.
pub fn run_traced(scenario: &Scenario, seed: u64, trace_len: Option<usize>) -> Report {
    let mut sim = Sim::new(scenario, seed, trace_len);
    let trace = sim.run();
    Report {
        scenario: scenario.name,
        seed,
        violations: std::mem::take(&mut sim.check.violations),
        trace,
        stats: sim.stats.clone(),
        balance: sim
            .director
            .take()
            .filter(|_| scenario.bubbles.is_none())
            .map(|d| d.figures),
    }
}
