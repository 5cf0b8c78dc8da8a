//! `cellmesh up`: a whole local cluster in one process, over real loopback sockets, with the
//! embedded in-memory stores: `nodes` sidecars, each with an arena game, sharing the world on a
//! grid partition; one proxy spreading sessions over them; and bots playing through it. The
//! arenas and the bots meet around the corner where every cell touches the others across the
//! wrap seam, so updates, ghosts and routed messages cross nodes all the time. Prints a live
//! status line and, on exit, a summary (optionally as JSON).
//!
//! With `--chaos SECS`, every node runs on a runtime of its own, and every SECS seconds one is
//! killed the way a crash kills a process (its runtime is dropped: every task and socket at
//! once, nothing flushed, its lease left to lapse) and a fresh one is started under its id.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use std::collections::{BTreeMap, BTreeSet};

use cellmesh_arena::{ArenaConfig, ArenaStats, Census};
use cellmesh_geo_router::geometry::WorldShape;
use cellmesh_geo_router::partition::{Bsp, Grid, Layout, Partition};
use cellmesh_geo_router::store::Stores;
use cellmesh_geo_router::topology::memory::MemoryTopology;
use cellmesh_geo_router::topology::TopologyStore;
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_proxy::ProxyConfig;
use cellmesh_sidecar::SidecarConfig;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bots::{self, BotConfig, BotStats};

pub mod plot;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct UpOptions {
    pub bots: usize,
    /// NPCs over all arenas.
    pub npcs: u32,
    /// Nodes sharing the world (a grid as square as the number allows).
    pub nodes: usize,
    /// Stop after this long; `None` runs until Ctrl-C / SIGTERM.
    pub duration: Option<Duration>,
    pub summary_json: Option<PathBuf>,
    pub seed: u64,
    /// Print the live status line.
    pub status: bool,
    /// Kill a random node this often (and start a fresh one).
    pub chaos: Option<Duration>,
    /// The fresh process starts in place of the killed one, keeping its state dir: it takes the
    /// node id over at once. Otherwise the killed node's machine is gone with it, and the fresh
    /// process waits for the lease to lapse.
    pub chaos_in_place: bool,
    /// Mesh links in plaintext instead of mutual TLS (a CA of this run issues every process's
    /// certificate): for measuring what TLS costs.
    pub mesh_plaintext: bool,
    /// The geos' names; more than one spreads the nodes over them (see [`GeoLayout`]).
    pub geos: Vec<String>,
    /// One-way delays between geos, and from a bot to a geo it is not in (ms): one value for
    /// every pair, or the upper triangle of the matrix in order (1–2, 1–3, …, 2–3, …); none takes
    /// [`known_one_way_ms`] for the geos it knows and 45 ms for the rest.
    pub geo_delay_ms: Vec<u64>,
    /// Draw the run as an SVG here on exit (see [`plot`]).
    pub svg: Option<PathBuf>,
    /// Lay the world out as a BSP (`Bsp::even`) instead of a grid of regions; the bots gather
    /// in one cell near where the lines meet, and each arena reports a load per entity (see
    /// [`Crowd`]).
    pub bsp: bool,
    /// Run a director in this process that balances the BSP (needs `bsp`).
    pub balance: bool,
    /// Where `up` serves its own admin HTTP: `/live`, `/ready`, the live map (`/map`,
    /// `/api/world`) and `/state` (the options and the status line's figures).
    pub admin_listen: String,
}

/// Delays between the default geos' cities, one way, roughly what the fibre gives (ms).
const KNOWN_ONE_WAY_MS: [(&str, &str, u64); 6] = [
    ("paris", "montreal", 45),
    ("paris", "hongkong", 110),
    ("paris", "sydney", 140),
    ("montreal", "hongkong", 120),
    ("montreal", "sydney", 110),
    ("hongkong", "sydney", 60),
];

/// The one-way delay between two geos [`KNOWN_ONE_WAY_MS`] knows, either way round.
pub fn known_one_way_ms(a: &str, b: &str) -> Option<u64> {
    KNOWN_ONE_WAY_MS
        .iter()
        .find(|(x, y, _)| (*x == a && *y == b) || (*x == b && *y == a))
        .map(|(_, _, ms)| *ms)
}

/// The delay between geos nobody named a figure for.
const DEFAULT_ONE_WAY_MS: u64 = 45;

/// A run over several geos: nodes in blocks per geo, each geo with its own session directory and
/// proxy, player records and topology shared (MongoDB is global). Latency between geos is shaped
/// in-process on the sidecars' peer links, and between bots and proxies by relays (the kernel
/// does not see it, so the proxies judge by their pings).
struct GeoLayout {
    names: Vec<String>,
    /// The geo of each node, by node id - 1.
    of_node: Vec<usize>,
    /// `one_way_ms[a][b]`: between geos `a` and `b` (unused on the diagonal).
    one_way_ms: Vec<Vec<u64>>,
}

impl GeoLayout {
    fn new(names: &[String], nodes: usize, delays: &[u64]) -> anyhow::Result<Self> {
        let names: Vec<String> = if names.is_empty() {
            vec!["local".into()]
        } else {
            names.to_vec()
        };
        anyhow::ensure!(
            nodes >= names.len(),
            "--geos {} needs at least as many nodes (--nodes {nodes})",
            names.len()
        );
        let of_node = (0..nodes).map(|i| i * names.len() / nodes).collect();
        let one_way_ms = delay_matrix(&names, delays)?;
        Ok(Self {
            names,
            of_node,
            one_way_ms,
        })
    }

    fn several(&self) -> bool {
        self.names.len() > 1
    }

    fn geo_of(&self, node: u32) -> usize {
        self.of_node[node as usize - 1]
    }

    /// A bot of `location` to a proxy of `geo`, one way.
    fn to_proxy(&self, location: usize, geo: usize) -> cellmesh_proto::shaping::OneWay {
        if location == geo {
            cellmesh_proto::shaping::OneWay::ms(2, 1)
        } else {
            cellmesh_proto::shaping::OneWay::ms(self.one_way_ms[location][geo], 3)
        }
    }

    /// How the delays read in a title: one figure, or each pair's.
    fn describe_delays(&self) -> String {
        let n = self.names.len();
        let pairs: Vec<(usize, usize)> = (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .collect();
        let first = pairs.first().map(|&(a, b)| self.one_way_ms[a][b]);
        if pairs
            .iter()
            .all(|&(a, b)| Some(self.one_way_ms[a][b]) == first)
        {
            return first.map_or_else(String::new, |ms| format!("{ms} ms one way"));
        }
        let each: Vec<String> = pairs
            .iter()
            .map(|&(a, b)| {
                format!(
                    "{}–{} {}",
                    self.names[a], self.names[b], self.one_way_ms[a][b]
                )
            })
            .collect();
        format!("{} ms one way", each.join(", "))
    }
}

/// The symmetric matrix of one-way delays between `names` from the figures given: none, one for
/// every pair, or the upper triangle row by row.
fn delay_matrix(names: &[String], delays: &[u64]) -> anyhow::Result<Vec<Vec<u64>>> {
    let n = names.len();
    let pairs = n * n.saturating_sub(1) / 2;
    anyhow::ensure!(
        delays.len() <= 1 || delays.len() == pairs,
        "--geo-delay-ms takes one delay for every pair of geos, or {pairs} for {n} geos (the \
         upper triangle of the matrix: 1–2, 1–3, …, 2–3, …); {} were given",
        delays.len()
    );
    let mut m = vec![vec![0; n]; n];
    let mut k = 0;
    for a in 0..n {
        for b in a + 1..n {
            let ms = match delays {
                [] => known_one_way_ms(&names[a], &names[b]).unwrap_or(DEFAULT_ONE_WAY_MS),
                [one] => *one,
                each => each[k],
            };
            k += 1;
            m[a][b] = ms;
            m[b][a] = ms;
        }
    }
    Ok(m)
}

impl Default for UpOptions {
    fn default() -> Self {
        Self {
            bots: 50,
            npcs: 100,
            nodes: 4,
            duration: None,
            summary_json: None,
            seed: 1,
            status: true,
            chaos: None,
            chaos_in_place: false,
            mesh_plaintext: false,
            geos: Vec::new(),
            geo_delay_ms: Vec::new(),
            svg: None,
            bsp: false,
            balance: false,
            admin_listen: "127.0.0.1:0".into(),
        }
    }
}

/// What a run did; written as `--summary-json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    pub nodes: usize,
    pub bots: usize,
    pub sessions_peak: u64,
    pub inputs_sent: u64,
    pub inputs_delivered: u64,
    pub inputs_applied: u64,
    /// Inputs the games received and ignored, by why: `duplicate` (a sequence number already
    /// applied: a double delivery), `while_frozen`, `no_player`, `stale_session`.
    pub inputs_ignored_by_games: BTreeMap<String, u64>,
    pub updates_delivered: u64,
    pub batches_delivered: u64,
    pub entities: u64,
    pub errors: u64,
    /// The errors by where they were counted: `bots_lost_session` (a bot's session broke or
    /// its login failed), `sidecar_<kind>` (a sidecar's `errors_total{kind}`), and
    /// `games_told` (errors the sidecars reported to their games: each also a `sidecar_` one).
    pub errors_by_kind: BTreeMap<String, u64>,
    pub kicks: u64,
    /// Bot logins refused `SERVER_FULL` (every gateway overloaded), retried after the hint.
    pub logins_refused: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    pub inputs_dropped_by_proxy: u64,
    /// Inputs the sidecars dropped, each under a named reason (`inputs_dropped_total{reason}`).
    pub inputs_dropped_by_sidecars: u64,
    /// Every input sent and not delivered, by where and why it was lost (see [`InputLedger`]).
    pub inputs_undelivered: BTreeMap<String, u64>,
    /// Sent, less delivered and undelivered under a reason: 0 when every input is accounted for.
    pub inputs_unaccounted: i64,
    /// Every hop's input counters the reasons were drawn from.
    pub inputs_by_hop: InputLedger,
    pub ghosts_render: u64,
    pub ghosts_sim: u64,
    pub subscriptions: u64,
    pub routed_messages: u64,
    pub cross_node_updates: u64,
    pub dropped_unknown_account: u64,
    /// Handoffs completed (entities that moved to another node).
    pub handoffs: u64,
    /// Entity commands handed to the game writing their target (the arenas' attacks and XP),
    /// and those that followed their target through a handoff on the way.
    pub commands_routed: u64,
    pub commands_forwarded_on_handoff: u64,
    /// Results the games got for their commands: ok, and every other (refused, entity gone,
    /// timeout, not delivered).
    pub command_results_ok: u64,
    pub command_results_failed: u64,
    /// Exclusive claims the sidecars granted (the arenas' trade escrows), and refused because
    /// another entity held the key.
    pub claims_granted: u64,
    pub claims_refused: u64,
    /// The arenas' trades: done (gift applied), refused by a claim held elsewhere, and opened
    /// while a player was in another trade by the census (must be 0).
    pub trades_done: u64,
    pub trades_refused: u64,
    pub trades_overlapping: u64,
    pub handoffs_refused: u64,
    pub handoff_freeze_ms_p50: f64,
    pub handoff_freeze_ms_p99: f64,
    /// Per completed handoff, game ticks in which nobody simulated the entity.
    pub handoff_ticks_missed_p50: f64,
    pub handoff_ticks_missed_p99: f64,
    /// The sidecars' own share of the freeze: the freeze less the time the two games took.
    pub handoff_freeze_sidecars_ms_p50: f64,
    pub handoff_freeze_sidecars_ms_p99: f64,
    /// Offers unanswered at the end (entities frozen, in doubt).
    pub in_doubt_now: u64,
    pub stale_epoch_drops: u64,
    /// Clients that saw an entity vanish from well inside their view when no game despawned it.
    pub vanished_on_handoff: u64,
    /// From a census of the world at rest (everything halted, no handoff in flight): every real
    /// of every node against what the games spawned and despawned.
    pub entities_alive: u64,
    pub entities_lost: u64,
    pub entities_duplicated: u64,
    /// Whether the world came to rest before the census (false: the figures above read a world
    /// still handing entities over).
    pub census_at_rest: bool,
    /// The cost of checkpoints in the geo's store: writes (one atomic write per node flush),
    /// checkpoints and bytes they carried, and the same per second per 1,000 entities.
    pub checkpoint_writes: u64,
    pub checkpoints_stored: u64,
    pub checkpoint_stored_bytes: u64,
    pub checkpoint_writes_per_s_per_1000_entities: f64,
    pub checkpoint_bytes_per_s_per_1000_entities: f64,
    /// `--chaos`: nodes killed, and the entities of theirs restored on live nodes: how long after
    /// the kill (the lease's lapse included) each was simulated again, and how far back its
    /// state went (the kill less when its restored state was taken).
    pub nodes_killed: u64,
    pub entities_restored: u64,
    pub restore_ms_p50: f64,
    pub restore_ms_p99: f64,
    pub progress_lost_ms_p50: f64,
    pub progress_lost_ms_p99: f64,
    /// Sessions moved to another gateway with the client connected, and sessions that ended
    /// without the client asking (kicked, or the connection lost).
    pub sessions_kept: u64,
    pub sessions_dropped: u64,
    /// Before the bots leave: accounts with more than one avatar in the world, and logged-in
    /// accounts with none. After they left: avatars still in the world.
    pub accounts_with_two_avatars: u64,
    pub sessions_without_avatar: u64,
    pub avatars_after_logout: u64,
    /// `--geos`: the geos, the most sessions bridged at once (simulated in another geo than
    /// their proxy's), handovers, how long a handed-over bot took from `Transfer` to `Welcome`,
    /// the logins whose hint or cookie saved the player record read, the reads that were made,
    /// and the click-to-screen time by bot location.
    pub geos: Vec<String>,
    pub bridged_sessions: u64,
    pub handovers: u64,
    pub handover_reconnect_ms_p50: f64,
    pub hint_hits: u64,
    pub cookie_hits: u64,
    pub mongo_reads_at_login: u64,
    pub probes_served: u64,
    pub input_to_update_ms: BTreeMap<String, Percentiles>,
    /// Bots handed over and then played on: the median over them of their click-to-screen
    /// medians before and after the handover.
    pub handed_over_bots: usize,
    /// Handed-over bots that found the same avatar (entity and inventory) in the new geo, or
    /// another one.
    pub handover_avatar_kept: u64,
    pub handover_avatar_replaced: u64,
    /// Handed-over bots that found the same entity, with a session before or after the handover
    /// that ended (the run's stop) before the inventory came: nothing to compare it with.
    pub handover_inventory_unseen: u64,
    pub handed_over_input_to_update_ms_before: f64,
    pub handed_over_input_to_update_ms_after: f64,
    /// `--partition bsp`: the layout's kind, the epochs committed during the run, what the
    /// director did (`--balance`), and the busiest node's load over the average (end of run, and
    /// over the run's seconds).
    pub partition: String,
    pub partition_epochs: u64,
    pub balance_moves: u64,
    pub cells_added: u64,
    pub cells_retired: u64,
    pub chunks_moved: u64,
    pub load_max_over_avg: LoadSpread,
}

/// The busiest node's load over the average of the nodes holding a cell.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadSpread {
    /// The last second's, before the bots left.
    pub end: f64,
    pub p50: f64,
    pub p99: f64,
    /// Seconds sampled (those with every node's load known).
    pub samples: usize,
}

/// The median and 99th percentile of some samples.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub samples: usize,
}

impl Percentiles {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            v.get(((v.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        Self {
            p50: at(0.5),
            p99: at(0.99),
            samples: v.len(),
        }
    }
}

impl Summary {
    /// What the run broke: an entity lost or held twice, or an input neither delivered nor
    /// dropped under a reason.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.entities_lost > 0 {
            p.push(format!("{} entities lost", self.entities_lost));
        }
        if self.entities_duplicated > 0 {
            p.push(format!("{} entities held twice", self.entities_duplicated));
        }
        if self.inputs_unaccounted != 0 {
            p.push(format!(
                "{} inputs unaccounted for ({} sent, {} delivered, undelivered by reason {:?})",
                self.inputs_unaccounted,
                self.inputs_sent,
                self.inputs_delivered,
                self.inputs_undelivered
            ));
        }
        if !self.census_at_rest {
            p.push("the world did not come to rest for the census".to_string());
        }
        if self.trades_overlapping > 0 {
            p.push(format!(
                "{} trades opened while a player was in another (two holders of a claim)",
                self.trades_overlapping
            ));
        }
        if self.accounts_with_two_avatars > 0 {
            p.push(format!(
                "{} accounts with two avatars",
                self.accounts_with_two_avatars
            ));
        }
        if self.sessions_without_avatar > 0 {
            p.push(format!(
                "{} sessions without an avatar",
                self.sessions_without_avatar
            ));
        }
        if self.avatars_after_logout > 0 {
            p.push(format!(
                "{} avatars left after every player logged out",
                self.avatars_after_logout
            ));
        }
        if self.nodes_killed > 0 && self.sessions_dropped > 0 {
            p.push(format!(
                "{} sessions dropped while nodes were killed",
                self.sessions_dropped
            ));
        }
        p
    }
}

/// Every hop's input counters at the end of a run: bots → proxy → gateway sidecar → (peer
/// sidecars) → game. Each hop counts what it read, passed on, dropped under a reason, and what
/// it wrote to connections that broke since, so every undelivered input gets a name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct InputLedger {
    pub bots_sent: u64,
    /// Sent on sessions that ended by a kick or an error.
    pub bots_on_broken_sessions: u64,
    pub proxy_received: u64,
    pub proxy_rate_limited: u64,
    pub proxy_lost: BTreeMap<&'static str, u64>,
    pub proxy_written: u64,
    /// Written to gateway link connections that ended since.
    pub proxy_on_ended_links: u64,
    pub sidecars_from_proxies: u64,
    pub sidecars_from_peers: u64,
    pub sidecars_forwarded: u64,
    pub sidecars_lost_in_links: u64,
    /// Forwarded on peer links that ended since.
    pub sidecars_on_ended_links: u64,
    pub sidecars_dropped: BTreeMap<&'static str, u64>,
    /// Inputs applied at a source after a refusal although a copy went to the target...
    pub sidecars_copies_applied: u64,
    /// ...and copies the target dropped for it: each pair is one input.
    pub sidecars_copies_refused: u64,
    /// Held at the end: for an entity still frozen (a handoff in doubt), for an epoch not seen
    /// yet, or for an older input after an adoption. An input and its copy can both be held.
    pub sidecars_held: u64,
    /// Held by nodes when they were killed (`--chaos`): lost with them.
    pub sidecars_held_by_killed: u64,
    pub delivered: u64,
}

impl InputLedger {
    /// The undelivered inputs by reason, and what no reason explains (sent − delivered − named;
    /// negative if inputs were counted twice).
    ///
    /// A connection that breaks loses what it carried and its reader never read. That loss is
    /// the gap between what one hop wrote and the next read, and it is named only up to what was
    /// written to connections that broke: a gap larger than that stays unaccounted.
    pub fn undelivered(&self) -> (BTreeMap<String, u64>, i64) {
        let mut by = BTreeMap::new();
        let mut add = |name: String, n: u64| {
            if n > 0 {
                *by.entry(name).or_insert(0) += n;
            }
        };
        let broken = |written: u64, read: u64, bound: u64| written.saturating_sub(read).min(bound);
        add(
            "client_connection_broken".into(),
            broken(
                self.bots_sent,
                self.proxy_received,
                self.bots_on_broken_sessions,
            ),
        );
        add("proxy_rate_limited".into(), self.proxy_rate_limited);
        for (reason, n) in &self.proxy_lost {
            add(format!("proxy_{reason}"), *n);
        }
        add(
            "gateway_link_broken".into(),
            broken(
                self.proxy_written,
                self.sidecars_from_proxies,
                self.proxy_on_ended_links,
            ),
        );
        add("peer_link_closed".into(), self.sidecars_lost_in_links);
        add(
            "peer_link_broken".into(),
            broken(
                self.sidecars_forwarded
                    .saturating_sub(self.sidecars_lost_in_links),
                self.sidecars_from_peers,
                self.sidecars_on_ended_links,
            ),
        );
        for (reason, n) in &self.sidecars_dropped {
            add(format!("sidecar_{reason}"), *n);
        }
        let named: u64 = by.values().sum();
        // An input applied at the source after a refusal also left as a copy, which the target
        // dropped (counted by neither hop) or a link lost (named above): take the copy back out.
        let copies = self.sidecars_copies_applied as i64 - self.sidecars_copies_refused as i64;
        let open = self.bots_sent as i64 - self.delivered as i64 - named as i64 + copies;
        // What killed nodes held, then what nodes still hold, explain a gap up to its size (an
        // input and its copy are two).
        let killed = (open.max(0) as u64).min(self.sidecars_held_by_killed);
        if killed > 0 {
            by.insert("sidecar_lost_with_node".into(), killed);
        }
        let open = open - killed as i64;
        let held = (open.max(0) as u64).min(self.sidecars_held);
        if held > 0 {
            by.insert("sidecar_held_at_end".into(), held);
        }
        (by, open - held as i64)
    }
}

/// The node lease under `--chaos`: the world of a killed node is restored once it lapses.
const CHAOS_NODE_LEASE_MS: u64 = 1_500;
/// No kill this close to the end of a run: the world settles before the census.
const CHAOS_QUIET_AT_END: Duration = Duration::from_secs(10);
/// A killed node's fresh process must be up within this long.
const CHAOS_RESTART_WITHIN_MS: u64 = 30_000;

/// Where everything meets: the corner every cell of a grid touches, across the wrap seam.
const MEETING_POINT: (f64, f64) = (0.0, 0.0);
/// Side of the square every arena's NPCs roam, around the meeting point, metres: they cross
/// every border all the time, and so are handed between the nodes.
const ARENA_SPREAD: f64 = 300.0;

/// A world laid out as a BSP (`--partition bsp`) gets a crowd for the director to balance:
/// every arena stands around the middle of the world, where every line of `Bsp::even` meets,
/// and the bots gather a few chunks away from it, inside one cell. Players walk fast (mounted),
/// so the crowd forms within the first half minute, and each entity is reported to cost a
/// quarter millisecond of a 50 ms tick: 200 gathered bots weigh a whole node.
struct Crowd;

impl Crowd {
    const GATHER_OFFSET_M: f64 = 160.0;
    const ROAM_M: f64 = 100.0;
    const ARENA_SPREAD_M: f64 = 600.0;
    const PLAYER_SPEED: f64 = 10.0;
    const ENTITY_COST_MS: f32 = 0.25;

    fn middle(world: &WorldShape) -> (f64, f64) {
        (world.width / 2.0, world.height / 2.0)
    }

    fn gather_point(world: &WorldShape) -> (f64, f64) {
        let (x, y) = Self::middle(world);
        (x - Self::GATHER_OFFSET_M, y - Self::GATHER_OFFSET_M)
    }
}

/// The busiest node's load over the average, from the nodes' latest reports; `None` until every
/// node holding a cell has reported.
async fn load_spread(topology: &dyn TopologyStore) -> Option<f64> {
    let partition = topology.partition().await.ok()??;
    let reports = topology.loads().await.ok()?;
    let loads: Vec<f64> = partition
        .nodes()
        .iter()
        .map(|n| reports.get(n).map(|r| r.load))
        .collect::<Option<_>>()?;
    let avg = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    (avg > 0.0).then(|| loads.iter().copied().fold(0.0, f64::max) / avg)
}

/// `cols × rows` for `n` nodes: the most square factorisation.
pub fn grid_shape(n: usize) -> (u32, u32) {
    let rows = (1..=n)
        .filter(|r| n.is_multiple_of(*r) && r * r <= n)
        .max()
        .unwrap_or(1);
    ((n / rows) as u32, rows as u32)
}

#[derive(Default)]
struct NodeTotals {
    entities: u64,
    inputs_delivered: u64,
    inputs_dropped: u64,
    errors: u64,
    ghosts_render: u64,
    ghosts_sim: u64,
    subscriptions: u64,
    routed_messages: u64,
    cross_node_updates: u64,
    dropped_unknown_account: u64,
    handoffs: u64,
    handoffs_refused: u64,
    commands_routed: u64,
    commands_forwarded_on_handoff: u64,
    command_results_ok: u64,
    command_results_failed: u64,
    claims_granted: u64,
    claims_refused: u64,
    in_doubt_now: u64,
    stale_epoch_drops: u64,
    inputs_from_proxies: u64,
    inputs_from_peers: u64,
    inputs_forwarded: u64,
    inputs_lost_in_links: u64,
    inputs_on_ended_links: u64,
    inputs_copies_applied: u64,
    inputs_copies_refused: u64,
    inputs_held: u64,
    inputs_dropped_by_reason: BTreeMap<&'static str, u64>,
    errors_by_kind: BTreeMap<&'static str, u64>,
    checkpoint_writes: u64,
    login_record_reads: u64,
    checkpoints_stored: u64,
    checkpoint_stored_bytes: u64,
}

impl NodeTotals {
    /// Adds the counters of `o` (not its gauges): what a killed node counted stays counted.
    fn add_counters(&mut self, o: &NodeTotals) {
        self.inputs_delivered += o.inputs_delivered;
        self.inputs_dropped += o.inputs_dropped;
        self.errors += o.errors;
        self.routed_messages += o.routed_messages;
        self.cross_node_updates += o.cross_node_updates;
        self.dropped_unknown_account += o.dropped_unknown_account;
        self.handoffs += o.handoffs;
        self.handoffs_refused += o.handoffs_refused;
        self.commands_routed += o.commands_routed;
        self.commands_forwarded_on_handoff += o.commands_forwarded_on_handoff;
        self.command_results_ok += o.command_results_ok;
        self.command_results_failed += o.command_results_failed;
        self.claims_granted += o.claims_granted;
        self.claims_refused += o.claims_refused;
        self.stale_epoch_drops += o.stale_epoch_drops;
        self.inputs_from_proxies += o.inputs_from_proxies;
        self.inputs_from_peers += o.inputs_from_peers;
        self.inputs_forwarded += o.inputs_forwarded;
        self.inputs_lost_in_links += o.inputs_lost_in_links;
        self.inputs_on_ended_links += o.inputs_on_ended_links;
        self.inputs_copies_applied += o.inputs_copies_applied;
        self.inputs_copies_refused += o.inputs_copies_refused;
        self.checkpoint_writes += o.checkpoint_writes;
        self.login_record_reads += o.login_record_reads;
        self.checkpoints_stored += o.checkpoints_stored;
        self.checkpoint_stored_bytes += o.checkpoint_stored_bytes;
        for (reason, n) in &o.inputs_dropped_by_reason {
            *self.inputs_dropped_by_reason.entry(reason).or_insert(0) += n;
        }
        for (kind, n) in &o.errors_by_kind {
            *self.errors_by_kind.entry(kind).or_insert(0) += n;
        }
    }
}

/// The handoff histograms of every node of the run, killed ones included.
struct HandoffCosts {
    freeze: hdrhistogram::Histogram<u64>,
    ticks_missed: hdrhistogram::Histogram<u64>,
    sidecars_ms: hdrhistogram::Histogram<u64>,
}

impl Default for HandoffCosts {
    fn default() -> Self {
        let h = || hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
        Self {
            freeze: h(),
            ticks_missed: h(),
            sidecars_ms: h(),
        }
    }
}

impl HandoffCosts {
    fn add(&mut self, s: &cellmesh_sidecar::SidecarHandle) {
        let _ = self.freeze.add(s.freeze_ms());
        let _ = self.ticks_missed.add(s.ticks_missed());
        let _ = self.sidecars_ms.add(s.freeze_sidecars_ms());
    }
}

/// One node of the run: its sidecar and its arena, on the runtime they were started on (one of
/// their own under `--chaos`, so that a kill drops every task and socket at once).
struct NodeRun {
    id: u32,
    sidecar: cellmesh_sidecar::SidecarHandle,
    arena: tokio::task::JoinHandle<anyhow::Result<ArenaStats>>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// What every node of the run is started with.
#[derive(Clone)]
struct NodeEnv {
    world: WorldShape,
    /// The stores of each geo (index: [`GeoLayout`]'s): a directory of its own, records shared.
    stores: Vec<Stores>,
    geos: Arc<GeoLayout>,
    topology: Arc<dyn TopologyStore>,
    games: Arc<Census>,
    halt: Arc<std::sync::atomic::AtomicBool>,
    stop: CancellationToken,
    seed: u64,
    /// Short leases under `--chaos`, so a killed node's world is restored within seconds.
    node_lease_ms: Option<u64>,
    own_runtime: bool,
    /// The nodes' state dir, of this run only (so are the in-memory topology and its leases);
    /// none unless killed nodes restart in place.
    state_dir: Option<Arc<RunDir>>,
    /// The CA of this run, which issues each node's mesh certificate as it starts; none with
    /// `--mesh-plaintext`.
    mesh_ca: Option<Arc<RunCa>>,
    /// The admin token of this run: every admin port of it asks for it.
    admin_token: Arc<str>,
    /// Where the arenas' NPCs and new players appear (see [`Crowd`] for a BSP).
    arena_center: (f64, f64),
    arena_spread: f64,
    player_speed: f64,
    entity_cost_ms: f32,
    /// The attest key of this run (`kid:secret`), shared by its proxies and sidecars: nobody
    /// outside it can attach a session.
    attest_key: String,
}

/// A directory of this run, removed with it.
struct RunDir(PathBuf);

impl RunDir {
    fn create() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "cellmesh-up-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the state dir {}", dir.display()))?;
        Ok(Self(dir))
    }
}

/// The admin token of one run, in a file of its own directory (removed with it) that only this
/// user may read: the banner names the file, never the token.
struct RunToken {
    token: String,
    file: PathBuf,
    _dir: RunDir,
}

impl RunToken {
    fn create() -> anyhow::Result<Self> {
        let dir = RunDir::create()?;
        let token = format!("{:032x}", rand::random::<u128>());
        let file = dir.0.join("admin-token");
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        std::io::Write::write_all(
            &mut options
                .open(&file)
                .with_context(|| format!("creating {}", file.display()))?,
            token.as_bytes(),
        )
        .with_context(|| format!("writing {}", file.display()))?;
        Ok(Self {
            token,
            file,
            _dir: dir,
        })
    }
}

/// A cluster CA made for one run (its directory removed with it): every sidecar and proxy gets
/// a certificate naming its role, node id and geo, and every mesh link is mutual TLS.
struct RunCa(RunDir);

impl RunCa {
    fn create() -> anyhow::Result<Self> {
        let dir = RunDir::create()?;
        cellmesh_trust::certs::init(&dir.0.join("ca"), "cellmesh up")?;
        Ok(Self(dir))
    }

    /// Issues `who`'s certificate into a directory named `label`; returns its `mesh_tls` keys.
    fn issue(
        &self,
        label: &str,
        who: &cellmesh_trust::Identity,
    ) -> anyhow::Result<cellmesh_trust::MeshTlsConfig> {
        let out = self.0 .0.join(label);
        cellmesh_trust::certs::issue(&self.0 .0.join("ca"), who, &out, 1)?;
        Ok(cellmesh_trust::MeshTlsConfig::in_dir(&out))
    }

    /// Issues a proxy's certificate for players on loopback into `label`; returns its
    /// `client_tls` keys.
    fn issue_edge(&self, label: &str) -> anyhow::Result<cellmesh_trust::ClientTlsConfig> {
        let out = self.0 .0.join(label);
        let hosts = ["127.0.0.1".to_string(), "localhost".to_string()];
        let issued = cellmesh_trust::certs::issue_edge(&self.0 .0.join("ca"), &hosts, &out, 1)?;
        Ok(cellmesh_trust::ClientTlsConfig {
            cert: issued.cert.display().to_string(),
            key: issued.key.display().to_string(),
        })
    }

    /// What the bots trust: this run's CA.
    fn client_tls(&self) -> anyhow::Result<cellmesh_proto::client::ClientTls> {
        let ca = self.0 .0.join("ca").join(cellmesh_trust::certs::CA_CERT);
        cellmesh_proto::client::ClientTls::from_ca_file(&ca).map_err(anyhow::Error::msg)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts node `id`'s sidecar (its mesh listener on `mesh_listen`) and its arena with `npcs`.
async fn start_node(
    env: &NodeEnv,
    id: u32,
    mesh_listen: String,
    npcs: u32,
    runtime: Option<tokio::runtime::Runtime>,
) -> (Option<tokio::runtime::Runtime>, anyhow::Result<NodeRun>) {
    let handle = runtime
        .as_ref()
        .map_or_else(tokio::runtime::Handle::current, |r| r.handle().clone());
    let geo = env.geos.geo_of(id);
    let mut cfg = SidecarConfig {
        node_id: id,
        geo: env.geos.names[geo].clone(),
        world: env.world,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen,
        admin_listen: "127.0.0.1:0".into(),
        admin_token: env.admin_token.to_string(),
        state_dir: env
            .state_dir
            .as_ref()
            .map(|d| d.0.to_string_lossy().into_owned())
            .unwrap_or_default(),
        attest_keys: vec![env.attest_key.clone()],
        ..SidecarConfig::default()
    };
    if let Some(ms) = env.node_lease_ms {
        cfg.node_lease_ms = ms;
    }
    if let Some(ca) = &env.mesh_ca {
        let who =
            cellmesh_trust::Identity::new(cellmesh_trust::Role::Sidecar, Some(id), Some(&cfg.geo))
                .map_err(anyhow::Error::msg);
        match who.and_then(|who| ca.issue(&format!("node-{id}"), &who)) {
            Ok(tls) => cfg.mesh_tls = tls,
            Err(e) => return (runtime, Err(e.context(format!("certifying node {id}")))),
        }
    }
    for (g, name) in env.geos.names.iter().enumerate() {
        if g != geo {
            cfg.shaping.to_geos.insert(
                name.clone(),
                cellmesh_proto::shaping::OneWay::ms(env.geos.one_way_ms[geo][g], 2),
            );
        }
    }
    let started = handle.spawn(cellmesh_sidecar::start_in(
        cfg,
        env.stores[geo].clone(),
        env.topology.clone(),
        env.stop.child_token(),
    ));
    let sidecar = match started.await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return (
                runtime,
                Err(e.context(format!("starting the sidecar of node {id}"))),
            )
        }
        Err(e) => return (runtime, Err(anyhow::anyhow!("starting node {id}: {e}"))),
    };
    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(sidecar.local_addr.clone()),
        npcs,
        seed: env.seed.wrapping_add(u64::from(id)),
        center: env.arena_center,
        spread: env.arena_spread,
        player_speed: env.player_speed,
        entity_cost_ms: env.entity_cost_ms,
        census: Some(env.games.clone()),
        halt: Some(env.halt.clone()),
        ..ArenaConfig::default()
    };
    let arena_stop = env.stop.child_token();
    let arena = handle.spawn(async move {
        cellmesh_arena::run(arena_cfg, async move { arena_stop.cancelled().await }).await
    });
    (
        None,
        Ok(NodeRun {
            id,
            sidecar,
            arena,
            runtime,
        }),
    )
}

fn node_runtime(id: u32) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("node-{id}"))
        .enable_all()
        .build()
        .with_context(|| format!("a runtime for node {id}"))
}

/// Drops a node's runtime the way a crash ends a process: every task and socket at once.
async fn crash(runtime: tokio::runtime::Runtime) {
    let _ =
        tokio::task::spawn_blocking(move || runtime.shutdown_timeout(Duration::from_secs(2))).await;
}

fn totals_of(sidecars: &[&cellmesh_sidecar::SidecarHandle]) -> NodeTotals {
    let mut t = NodeTotals::default();
    for s in sidecars.iter().map(|h| h.stats()) {
        t.entities += s.entities;
        t.inputs_delivered += s.inputs_delivered;
        t.inputs_dropped += s.inputs_dropped;
        t.errors += s.errors;
        t.ghosts_render += s.ghosts_render;
        t.ghosts_sim += s.ghosts_sim;
        t.subscriptions += s.subscriptions;
        t.routed_messages += s.routed_messages;
        t.cross_node_updates += s.cross_node_updates;
        t.dropped_unknown_account += s.dropped_unknown_account;
        t.handoffs += s.handoffs;
        t.handoffs_refused += s.handoffs_refused;
        t.commands_routed += s.commands_delivered;
        t.commands_forwarded_on_handoff += s.commands_forwarded_on_handoff;
        t.command_results_ok += s.command_results_ok;
        t.command_results_failed += s.command_results_failed;
        t.claims_granted += s.claims_granted;
        t.claims_refused += s.claims_refused;
        t.in_doubt_now += s.in_doubt_now;
        t.stale_epoch_drops += s.stale_epoch_drops;
        t.inputs_from_proxies += s.inputs_from_proxies;
        t.inputs_from_peers += s.inputs_from_peers;
        t.inputs_forwarded += s.inputs_forwarded;
        t.inputs_lost_in_links += s.inputs_lost_in_links;
        t.inputs_on_ended_links += s.inputs_on_ended_links;
        t.inputs_copies_applied += s.inputs_copies_applied;
        t.inputs_copies_refused += s.inputs_copies_refused;
        t.inputs_held += s.inputs_held;
        t.checkpoint_writes += s.checkpoint_writes;
        t.login_record_reads += s.login_record_reads;
        t.checkpoints_stored += s.checkpoints_stored;
        t.checkpoint_stored_bytes += s.checkpoint_stored_bytes;
        for (reason, n) in s.inputs_dropped_by_reason {
            *t.inputs_dropped_by_reason.entry(reason).or_insert(0) += n;
        }
        for (kind, n) in s.errors_by_kind {
            *t.errors_by_kind.entry(kind).or_insert(0) += n;
        }
    }
    t
}

fn totals(nodes: &[NodeRun], departed: &NodeTotals) -> NodeTotals {
    let mut t = totals_of(&nodes.iter().map(|n| &n.sidecar).collect::<Vec<_>>());
    t.add_counters(departed);
    t
}

/// One census: the reals every node writes, against what the games spawned and despawned.
#[derive(Debug, PartialEq, Eq)]
struct CensusRead {
    lost: BTreeSet<u64>,
    duplicated: BTreeSet<u64>,
    alive: usize,
    /// Reals frozen for a handoff (in flight).
    frozen: usize,
}

fn census(nodes: &[NodeRun], games: &Census) -> CensusRead {
    let report = games.report();
    let mut held: BTreeMap<u64, Vec<cellmesh_sidecar::Real>> = BTreeMap::new();
    for n in nodes {
        for r in n.sidecar.reals() {
            held.entry(r.id).or_default().push(r);
        }
    }
    // Lost: alive in the games, and no node writes it (unfrozen).
    let lost = report
        .alive
        .iter()
        .filter(|id| held.get(id).is_none_or(|rs| rs.iter().all(|r| r.frozen)))
        .chain(report.lost().iter())
        .copied()
        .collect();
    let frozen = held.values().flatten().filter(|r| r.frozen).count();
    // Two writers: two nodes writing it unfrozen, or two games holding it.
    let duplicated = held
        .iter()
        .filter(|(_, rs)| rs.iter().filter(|r| !r.frozen).count() > 1)
        .map(|(id, _)| *id)
        .chain(report.duplicated())
        .collect();
    CensusRead {
        lost,
        duplicated,
        alive: report.alive.len(),
        frozen,
    }
}

/// Runs the cluster until the duration ends or `interrupt` completes.
pub async fn run(
    opts: UpOptions,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let stop = CancellationToken::new();
    anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
    let geos = Arc::new(GeoLayout::new(&opts.geos, opts.nodes, &opts.geo_delay_ms)?);
    // One directory, claim store (and board) per geo, as a Redis per geo would hold them;
    // player records and checkpoints shared.
    let shared = Stores::in_memory();
    let stores: Vec<Stores> = (0..geos.names.len())
        .map(|g| {
            if g == 0 {
                return shared.clone();
            }
            Stores {
                directory: Arc::new(cellmesh_geo_router::store::memory::MemoryDirectory::default()),
                claims: Arc::new(cellmesh_geo_router::store::claims::MemoryClaims::default()),
                ..shared.clone()
            }
        })
        .collect();

    anyhow::ensure!(
        opts.nodes as u32 <= cellmesh_geo_router::topology::MAX_NODE_ID,
        "--nodes {} is more than node ids allow",
        opts.nodes
    );
    let world = WorldShape::default();
    let (cols, rows) = grid_shape(opts.nodes);
    let ids: Vec<u32> = (1..=opts.nodes as u32).collect();
    let (rx, ry) = (world.regions_x() as u32, world.regions_y() as u32);
    anyhow::ensure!(
        opts.bsp || !opts.balance,
        "--balance needs a BSP partition (--partition bsp): the director moves the lines of a BSP"
    );
    let layout = if opts.bsp {
        // Halved and halved again, as even as the number allows; the director moves the lines.
        Layout::Bsp(Bsp::even(&world, &ids).context("laying out the BSP")?)
    } else {
        // The fixed grid of regions, shared out in compact blocks (2 × 2 quadrants for 4 nodes).
        Layout::Grid(Grid::even(&world, rx, ry, &ids).context("laying out the grid")?)
    };
    let partition = Partition::new(world, 1, layout).context("the partition")?;
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    topology
        .commit_partition(0, &partition)
        .await
        .context("committing the partition")?;

    // The run's own admin port: the live map draws the same store the nodes and the director
    // share. Ready once the cluster is.
    let up_admin = cellmesh_admin::Admin::new(prometheus_client::registry::Registry::default(), {
        let nodes = opts.nodes;
        let geos = opts.geos.clone();
        move || serde_json::json!({"nodes": nodes, "geos": geos})
    });
    // One admin token for every admin port of the run, its own included.
    let admin_token = RunToken::create().context("making the run's admin token")?;
    up_admin.set_token(&admin_token.token);
    crate::live_map::serve(&up_admin, topology.clone(), &admin_token.token);
    let up_admin_addr = cellmesh_admin::spawn(&opts.admin_listen, up_admin.clone(), stop.clone())
        .await
        .with_context(|| format!("binding the admin port --admin {}", opts.admin_listen))?;

    let games = Arc::new(Census::default());
    let halt = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let env = NodeEnv {
        attest_key: format!("run:{:032x}", rand::random::<u128>()),
        world,
        stores,
        geos: geos.clone(),
        topology: topology.clone(),
        games: games.clone(),
        halt: halt.clone(),
        stop: stop.clone(),
        seed: opts.seed,
        node_lease_ms: opts.chaos.map(|_| CHAOS_NODE_LEASE_MS),
        own_runtime: opts.chaos.is_some(),
        state_dir: if opts.chaos_in_place {
            Some(Arc::new(RunDir::create()?))
        } else {
            None
        },
        mesh_ca: if opts.mesh_plaintext {
            None
        } else {
            Some(Arc::new(RunCa::create()?))
        },
        admin_token: admin_token.token.as_str().into(),
        arena_center: if opts.bsp {
            Crowd::middle(&world)
        } else {
            MEETING_POINT
        },
        arena_spread: if opts.bsp {
            Crowd::ARENA_SPREAD_M
        } else {
            ARENA_SPREAD
        },
        player_speed: if opts.bsp {
            Crowd::PLAYER_SPEED
        } else {
            ArenaConfig::default().player_speed
        },
        entity_cost_ms: if opts.bsp { Crowd::ENTITY_COST_MS } else { 0.0 },
    };
    let mut nodes: Vec<NodeRun> = Vec::with_capacity(opts.nodes);
    let per_arena = opts.npcs.div_ceil(opts.nodes as u32);
    for (i, &node_id) in ids.iter().enumerate() {
        let runtime = env.own_runtime.then(|| node_runtime(node_id)).transpose()?;
        let npcs = per_arena.min(opts.npcs.saturating_sub(per_arena * i as u32));
        let (_, node) = start_node(&env, node_id, "127.0.0.1:0".into(), npcs, runtime).await;
        nodes.push(node?);
    }
    let (home, roam) = if opts.bsp {
        (Crowd::gather_point(&world), Crowd::ROAM_M)
    } else {
        (MEETING_POINT, ARENA_SPREAD / 2.0)
    };
    // Stopped when the bots leave: the census reads a world whose layout holds still.
    let director_stop = stop.child_token();
    let director = if opts.balance {
        let cfg = crate::director::DirectorConfig {
            topology_url: "memory".into(),
            admin_listen: "127.0.0.1:0".into(),
            admin_token: admin_token.token.clone(),
            name: "up-director".into(),
            balance: cellmesh_geo_router::balance::LoadConfig {
                // The world starts with the NPCs alone while the bots log in: with the default
                // bound a cell would start to retire in the first second, only to be called off.
                lower_bound: 0.1,
                ..Default::default()
            },
            ..crate::director::DirectorConfig::default()
        };
        Some(
            crate::director::start_with(cfg, topology.clone(), director_stop.clone())
                .await
                .context("starting the director")?,
        )
    } else {
        None
    };

    // A secret of this run only: nobody outside it can sign a login.
    let secret = format!("{:032x}", rand::random::<u128>());
    // Every bot connects from 127.0.0.1: the per-address limits must admit all of them (twice
    // over, for a bot reconnecting while its old connection closes).
    let bot_conns = u32::try_from(opts.bots)
        .unwrap_or(u32::MAX)
        .saturating_mul(2);
    // One proxy per geo; with several, each knows the others' (picked ahead, so that each can
    // name the rest) and their boards (shared in memory, as each geo's Redis would be).
    let proxy_addrs: Vec<String> = (0..geos.names.len())
        .map(|_| free_loopback_addr())
        .collect::<anyhow::Result<_>>()?;
    let boards = cellmesh_proxy::Boards {
        by_geo: geos
            .names
            .iter()
            .map(|g| {
                (
                    g.clone(),
                    Arc::new(cellmesh_geo_router::store::memory::MemoryBoard::default())
                        as Arc<dyn cellmesh_geo_router::store::EdgeBoard>,
                )
            })
            .collect(),
    };
    let mut proxies = Vec::with_capacity(geos.names.len());
    for (g, name) in geos.names.iter().enumerate() {
        let mut cfg = ProxyConfig {
            name: format!("proxy-{name}"),
            geo: name.clone(),
            client_listen: if geos.several() {
                proxy_addrs[g].clone()
            } else {
                "127.0.0.1:0".into()
            },
            admin_listen: "127.0.0.1:0".into(),
            gateways: nodes
                .iter()
                .filter(|n| geos.geo_of(n.id) == g)
                .map(|n| n.sidecar.mesh_addr.to_string())
                .collect(),
            token_secret: secret.clone(),
            attest_keys: vec![env.attest_key.clone()],
            admin_token: admin_token.token.clone(),
            ..ProxyConfig::default()
        };
        if let Some(ca) = &env.mesh_ca {
            let who = cellmesh_trust::Identity::new(cellmesh_trust::Role::Proxy, None, Some(name))
                .map_err(anyhow::Error::msg)?;
            cfg.mesh_tls = ca.issue(&format!("proxy-{name}"), &who)?;
            cfg.client_tls = ca.issue_edge(&format!("proxy-{name}-edge"))?;
        }
        cfg.rate.address_accounts = cfg.rate.address_accounts.max(bot_conns);
        cfg.max_connections_per_address = cfg.max_connections_per_address.max(bot_conns as usize);
        cfg.max_connections = cfg.max_connections.max(bot_conns as usize);
        // One process stops as a whole: nothing to drain towards.
        cfg.drain_grace_ms = 0;
        cfg.drain_spread_ms = 0;
        if geos.several() {
            cfg.geos.peers = geos
                .names
                .iter()
                .enumerate()
                .filter(|(o, _)| *o != g)
                .map(|(o, other)| cellmesh_proxy::PeerGeo {
                    name: other.clone(),
                    proxies: proxy_addrs[o].clone(),
                    board: "memory".into(),
                })
                .collect();
            // The shaping is in-process: the kernel sees loopback, the pings see the latency.
            cfg.geos.kernel_rtt = false;
            cfg.geos.probe_every_ms = 10_000;
            // A demo of a minute: settle and bridge briefly.
            cfg.geos.handover.settle_ms = 5_000;
            cfg.geos.handover.settle_depth_m = 20.0;
            cfg.geos.handover.max_bridge_ms = 20_000;
            cfg.geos.handover.min_samples = 3;
        }
        let proxy = cellmesh_proxy::start_with(cfg, stop.child_token(), Some(boards.clone()))
            .await
            .with_context(|| format!("starting the proxy of geo {name}"))?;
        proxies.push(proxy);
    }

    let deadline = Instant::now() + Duration::from_secs(15);
    let linked = |s: &cellmesh_sidecar::SidecarHandle| {
        let st = s.stats();
        st.game_connected && st.peers_up as usize == opts.nodes - 1
    };
    while !(nodes.iter().all(|n| linked(&n.sidecar)) && proxies.iter().all(|p| p.admin.is_ready()))
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the cluster did not become ready within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let admins: Vec<String> = nodes
        .iter()
        .map(|n| format!("http://{}", n.sidecar.admin_addr))
        .collect();
    let edges: Vec<String> = proxies
        .iter()
        .zip(&geos.names)
        .map(|(p, g)| {
            if geos.several() {
                format!(
                    "{g}: clients {} admin http://{}",
                    p.client_addr, p.admin_addr
                )
            } else {
                format!("clients {} admin http://{}", p.client_addr, p.admin_addr)
            }
        })
        .collect();
    let layout = if opts.bsp {
        "bsp".to_string()
    } else {
        format!("{cols}×{rows}")
    };
    let director_admin = director
        .as_ref()
        .map(|d| format!(" · director admin http://{}", d.admin_addr))
        .unwrap_or_default();
    up_admin.set_ready(true);
    println!(
        "cellmesh up: {} nodes ({layout}), sidecar admin {} · proxy {}{director_admin} · {} bots",
        opts.nodes,
        admins.join(" "),
        edges.join(" · "),
        opts.bots
    );
    // The token's file, not the token: a terminal's scrollback and a CI log are read by many.
    println!(
        "cellmesh up: admin token in {}: send \"Authorization: Bearer $(cat {0})\" (all but /live, /ready, /metrics); the live map asks for it once",
        admin_token.file.display()
    );
    println!("cellmesh up: live map http://{up_admin_addr}/map");

    // Bots: each plays from a geo (round robin); from there every proxy is a relay away that adds
    // the latency. A quarter log in far from home (to the next geo's proxy), as travellers or
    // misrouted players do: the handover policy is for them.
    let mut bot_cfgs: Vec<Arc<BotConfig>> = Vec::new();
    let bot_tls = env.mesh_ca.as_ref().map(|ca| ca.client_tls()).transpose()?;
    for location in 0..geos.names.len() {
        let mut via = std::collections::HashMap::new();
        if geos.several() {
            for (g, p) in proxies.iter().enumerate() {
                let relay = cellmesh_proto::shaping::relay(
                    p.client_addr,
                    geos.to_proxy(location, g),
                    stop.child_token(),
                )
                .await
                .context("starting a latency relay")?;
                via.insert(p.client_addr.to_string(), relay.to_string());
            }
        }
        for start in [location, (location + 1) % geos.names.len()] {
            bot_cfgs.push(Arc::new(BotConfig {
                proxy: proxies[start].client_addr.to_string(),
                secret: secret.clone(),
                home,
                roam,
                seed: opts.seed,
                census: Some(games.clone()),
                geo: geos.several().then(|| bots::BotGeo {
                    location: geos.names[location].clone(),
                    via: via.clone(),
                }),
                tls: bot_tls.clone(),
                ..BotConfig::default()
            }));
        }
    }
    let bot_cfg_of = |i: usize| {
        let n = geos.names.len();
        let (location, far) = (i % n, i / n % 4 == 3 && n > 1);
        bot_cfgs[location * 2 + usize::from(far)].clone()
    };
    let bot_stats = Arc::new(BotStats {
        click_to_screen: bots::ClickToScreen::starting(started),
        ..BotStats::default()
    });
    let bot_stop = CancellationToken::new();
    let mut bot_tasks = Vec::with_capacity(opts.bots);
    for i in 0..opts.bots {
        let (cfg, stats, stop) = (bot_cfg_of(i), bot_stats.clone(), bot_stop.clone());
        bot_tasks.push(tokio::spawn(bots::run_bot(
            format!("bot-{i}"),
            cfg,
            stats,
            stop,
        )));
    }

    // Live status until the end.
    let tty = std::io::stdout().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = (Instant::now(), 0u64, 0u64);
    // The most entities the nodes wrote at once: what the checkpoint cost is per.
    let mut entities_peak = 0u64;
    let end = opts.duration.map(|d| tokio::time::Instant::now() + d);
    // What killed nodes counted, held and restored, and when each was killed.
    let mut departed = NodeTotals::default();
    let mut held_by_killed = 0u64;
    let mut departed_handoffs = HandoffCosts::default();
    let mut departed_arenas: Vec<ArenaStats> = Vec::new();
    let mut restored: Vec<cellmesh_sidecar::core::Restored> = Vec::new();
    let mut kills: Vec<(u32, u64)> = Vec::new();
    let mut chaos_rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let next_kill = |from: tokio::time::Instant| {
        opts.chaos
            .map(|every| from + every)
            // The world gets time to settle before the end.
            .filter(|at| end.is_none_or(|e| *at + CHAOS_QUIET_AT_END <= e))
    };
    let mut kill_at = next_kill(tokio::time::Instant::now());
    let mut bridged_peak = 0u64;
    let mut spreads: Vec<f64> = Vec::new();
    // What the plot shows, timed from `started`.
    let started_unix_ms = unix_ms().saturating_sub(started.elapsed().as_millis() as u64);
    let mut bridged_over_time: Vec<(f64, u64)> = Vec::new();
    let mut handover_marks: Vec<plot::HandoverMark> = Vec::new();
    let mut kill_marks: Vec<plot::KillMark> = Vec::new();
    let take_handovers = |marks: &mut Vec<plot::HandoverMark>| {
        for (g, proxy) in proxies.iter().enumerate() {
            marks.extend(
                proxy
                    .take_handovers()
                    .into_iter()
                    .map(|r| plot::HandoverMark {
                        t_s: r.unix_ms.saturating_sub(started_unix_ms) as f64 / 1000.0,
                        account: r.account,
                        from: geos.names[g].clone(),
                        to: r.to_geo,
                        because: r.because,
                    }),
            );
        }
    };
    tokio::pin!(interrupt);
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = async { match end { Some(e) => tokio::time::sleep_until(e).await, None => std::future::pending().await } } => break,
            _ = async { match kill_at { Some(k) => tokio::time::sleep_until(k).await, None => std::future::pending().await } } => {
                let victim = chaos_rng.random_range(0..nodes.len());
                for n in &nodes {
                    restored.extend(n.sidecar.take_restored());
                }
                let id = nodes[victim].id;
                let mesh_listen = nodes[victim].sidecar.mesh_addr.to_string();
                let runtime = nodes[victim].runtime.take().expect("chaos nodes own their runtime");
                crash(runtime).await;
                kills.push((id, unix_ms()));
                let killed_at_s = started.elapsed().as_secs_f64();
                games.release_holder(id);
                let dead = nodes.remove(victim);
                let last = totals_of(&[&dead.sidecar]);
                departed.add_counters(&last);
                held_by_killed += last.inputs_held;
                departed_handoffs.add(&dead.sidecar);
                restored.extend(dead.sidecar.take_restored());
                if let Ok(Ok(Ok(st))) = tokio::time::timeout(Duration::from_millis(100), dead.arena).await {
                    departed_arenas.push(st);
                }
                tracing::warn!(node = id, "chaos: node killed; starting a fresh one");
                // In place, the fresh process finds the dead one's lock gone with its runtime and
                // takes its lease over at once; otherwise it gets the id once the lease lapsed.
                let mut runtime = Some(node_runtime(id)?);
                let fresh = loop {
                    let (rt, started) = start_node(&env, id, mesh_listen.clone(), 0, runtime.take()).await;
                    match started {
                        Ok(n) => break n,
                        Err(e) => {
                            runtime = rt;
                            anyhow::ensure!(unix_ms() < kills.last().expect("pushed").1 + CHAOS_RESTART_WITHIN_MS, "chaos: node {id} did not start again: {e:#}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                };
                nodes.insert(victim, fresh);
                kill_marks.push(plot::KillMark {
                    node: id,
                    geo: geos.several().then(|| geos.names[geos.geo_of(id)].clone()),
                    from_s: killed_at_s,
                    to_s: started.elapsed().as_secs_f64(),
                });
                kill_at = next_kill(kill_at.expect("a kill was due"));
            }
            _ = tick.tick() => {
                entities_peak = entities_peak.max(totals(&nodes, &departed).entities);
                for n in &nodes {
                    restored.extend(n.sidecar.take_restored());
                }
                let p = proxy_stats(&proxies);
                bridged_peak = bridged_peak.max(p.bridged_sessions);
                if geos.several() {
                    bridged_over_time.push((started.elapsed().as_secs_f64(), p.bridged_sessions));
                }
                take_handovers(&mut handover_marks);
                let spread = load_spread(&*topology).await;
                spreads.extend(spread);
                if !opts.status { continue }
                let (s, b) = (totals(&nodes, &departed), bot_stats.totals());
                let dt = last.0.elapsed().as_secs_f64().max(1e-3);
                let line = format!(
                    "t={:>4.0}s nodes={} killed={} sessions={:>4} entities={:>5} ghosts={}/{} subs={} xnode={} routed={} handoffs={} in_doubt={} inputs/s={:>6.0} updates/s={:>7.0} rtt p50={:.2}ms p99={:.2}ms errors={}",
                    started.elapsed().as_secs_f64(), opts.nodes, kills.len(), p.sessions, s.entities,
                    s.ghosts_render, s.ghosts_sim, s.subscriptions, s.cross_node_updates, s.routed_messages,
                    s.handoffs, s.in_doubt_now,
                    (s.inputs_delivered - last.1) as f64 / dt,
                    (b.updates_delivered - last.2) as f64 / dt,
                    p.rtt_ms_p50, p.rtt_ms_p99, b.errors + s.errors,
                );
                let line = format!(
                    "{line} commands_routed={} commands_forwarded_on_handoff={} claims_granted={} claims_refused={}",
                    s.commands_routed, s.commands_forwarded_on_handoff, s.claims_granted, s.claims_refused,
                );
                let line = if geos.several() {
                    format!("{line} bridged={} handovers={}", p.bridged_sessions, p.handovers)
                } else {
                    line
                };
                let line = match &director {
                    Some(d) => {
                        let st = d.stats();
                        format!(
                            "{line} epoch={} moves={} load max/avg={}",
                            st.partition_epoch.max(1), st.balance_moves,
                            spread.map_or("-".into(), |m| format!("{m:.2}")),
                        )
                    }
                    None if opts.bsp => format!("{line} load max/avg={}", spread.map_or("-".into(), |m| format!("{m:.2}"))),
                    None => line,
                };
                last = (Instant::now(), s.inputs_delivered, b.updates_delivered);
                if tty { print!("\r{line}  "); use std::io::Write; let _ = std::io::stdout().flush(); } else { println!("{line}"); }
            }
        }
    }
    if tty && opts.status {
        println!();
    }

    // Bots first; then every game halts (the world comes to rest for the census), and in-flight
    // inputs land before the counters are read. An overloaded cluster is seconds behind, so this
    // waits until every input is accounted for, or the ledger holds still for longer than a dead
    // link takes to be noticed (whose inputs are named only once it is), at most 30 s.
    // One avatar per logged-in account, none for anyone else (read before the bots leave).
    let avatars = games.avatars();
    let accounts_with_two_avatars = avatars.values().filter(|ids| ids.len() > 1).count() as u64;
    let sessions_without_avatar = bot_stats
        .online_accounts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|a| !avatars.contains_key(*a))
        .count() as u64;
    if accounts_with_two_avatars > 0 || sessions_without_avatar > 0 {
        tracing::error!(
            accounts_with_two_avatars,
            sessions_without_avatar,
            "avatars do not match the sessions"
        );
    }
    bot_stop.cancel();
    director_stop.cancel();
    let directed = match director {
        Some(d) => {
            let st = d.stats();
            let _ = tokio::time::timeout(Duration::from_secs(5), d.wait()).await;
            st
        }
        None => crate::director::DirectorStats::default(),
    };
    let load_end = spreads.last().copied().unwrap_or(0.0);
    for t in bot_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    halt.store(true, std::sync::atomic::Ordering::Relaxed);
    let ledger = || {
        let (s, p, b) = (
            totals(&nodes, &departed),
            proxy_stats(&proxies),
            bot_stats.totals(),
        );
        let ledger = InputLedger {
            bots_sent: b.inputs_sent,
            bots_on_broken_sessions: b.inputs_on_broken_sessions,
            proxy_received: p.inputs_received,
            proxy_rate_limited: p.inputs_dropped,
            proxy_lost: p.inputs_lost.clone(),
            proxy_written: p.inputs_written,
            proxy_on_ended_links: p.inputs_on_ended_links,
            sidecars_from_proxies: s.inputs_from_proxies,
            sidecars_from_peers: s.inputs_from_peers,
            sidecars_forwarded: s.inputs_forwarded,
            sidecars_lost_in_links: s.inputs_lost_in_links,
            sidecars_on_ended_links: s.inputs_on_ended_links,
            sidecars_dropped: s.inputs_dropped_by_reason.clone(),
            sidecars_copies_applied: s.inputs_copies_applied,
            sidecars_copies_refused: s.inputs_copies_refused,
            sidecars_held: s.inputs_held,
            sidecars_held_by_killed: held_by_killed,
            delivered: s.inputs_delivered,
        };
        (ledger, s, p, b)
    };
    let settle = Instant::now() + Duration::from_secs(30);
    let (mut inputs_by_hop, mut s, mut p, mut b) = ledger();
    let mut still = 0;
    // The proxy's link silence (the sidecar's is the same).
    let still_for = (cellmesh_proxy::LINK_SILENCE + Duration::from_secs(1)).as_millis() / 300;
    // Held inputs may still go on: they are waited for like an open gap.
    let open = |l: &InputLedger| l.undelivered().1 != 0 || l.sidecars_held > 0;
    while open(&inputs_by_hop) && still < still_for && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let next = ledger();
        still = if next.0 == inputs_by_hop {
            still + 1
        } else {
            0
        };
        (inputs_by_hop, s, p, b) = next;
    }
    // The census reads a world at rest: it waits until no node has a real frozen for a handoff
    // and two reads 300 ms apart agree (at most 10 s).
    let rest_deadline = Instant::now() + Duration::from_secs(10);
    let mut previous = census(&nodes, &games);
    let census_at_rest = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = census(&nodes, &games);
        if now.frozen == 0 && now == previous {
            previous = now;
            break true;
        }
        previous = now;
        if Instant::now() >= rest_deadline {
            break false;
        }
    };
    let (lost, duplicated): (Vec<u64>, Vec<u64>) = (
        previous.lost.iter().copied().collect(),
        previous.duplicated.iter().copied().collect(),
    );
    let second = previous;
    if !lost.is_empty() || !duplicated.is_empty() {
        tracing::error!(
            ?lost,
            ?duplicated,
            "the census found entities lost or doubled"
        );
    }
    let mut handoff_costs = departed_handoffs;
    for n in &nodes {
        handoff_costs.add(&n.sidecar);
        restored.extend(n.sidecar.take_restored());
    }
    let in_doubt_now = totals(&nodes, &departed).in_doubt_now;
    let avatars_after_logout = games.avatars().values().map(|ids| ids.len() as u64).sum();

    stop.cancel();
    let mut arena_stats = ArenaStats::default();
    let mut inputs_ignored_by_games = BTreeMap::new();
    let mut ended = Vec::new();
    for n in nodes.iter_mut() {
        ended.push(
            match tokio::time::timeout(Duration::from_secs(5), &mut n.arena).await {
                Ok(Ok(r)) => Some(r),
                _ => None,
            },
        );
    }
    let all = departed_arenas
        .into_iter()
        .map(|st| Some(Ok(st)))
        .chain(ended);
    for arena in all {
        match arena {
            Some(Ok(st)) => {
                arena_stats.inputs_applied += st.inputs_applied;
                arena_stats.errors_from_sidecar += st.errors_from_sidecar;
                arena_stats.trades_done += st.trades_done;
                arena_stats.trades_refused += st.trades_refused;
                for (why, n) in [
                    ("duplicate", st.inputs_duplicate),
                    ("while_frozen", st.inputs_while_frozen),
                    ("no_player", st.inputs_no_player),
                    ("stale_session", st.inputs_stale_session),
                ] {
                    if n > 0 {
                        *inputs_ignored_by_games.entry(why.to_string()).or_insert(0) += n;
                    }
                }
            }
            Some(Err(e)) => tracing::warn!(error = %e, "arena ended with an error"),
            None => {}
        }
    }
    take_handovers(&mut handover_marks);
    for proxy in proxies {
        let _ = tokio::time::timeout(Duration::from_secs(5), proxy.wait()).await;
    }
    for n in nodes {
        let _ = tokio::time::timeout(Duration::from_secs(5), n.sidecar.wait()).await;
        if let Some(rt) = n.runtime {
            let _ =
                tokio::task::spawn_blocking(move || rt.shutdown_timeout(Duration::from_secs(1)))
                    .await;
        }
    }
    let chaos = chaos_figures(&kills, &restored);

    let (inputs_undelivered, inputs_unaccounted) = inputs_by_hop.undelivered();
    let handed_over = bot_stats
        .handed_over_input_to_update_ms
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    // Epochs past the first, whoever committed them (the director, or a failover).
    let partition_epochs = topology
        .partition()
        .await
        .ok()
        .flatten()
        .map_or(0, |p| p.epoch() - 1);
    let summary = Summary {
        duration_s: started.elapsed().as_secs_f64(),
        nodes: opts.nodes,
        bots: opts.bots,
        sessions_peak: p.sessions_peak,
        inputs_sent: b.inputs_sent,
        inputs_delivered: s.inputs_delivered,
        inputs_applied: arena_stats.inputs_applied,
        inputs_ignored_by_games,
        updates_delivered: b.updates_delivered,
        batches_delivered: b.batches,
        entities: s.entities,
        errors: b.errors + s.errors + arena_stats.errors_from_sidecar,
        errors_by_kind: s
            .errors_by_kind
            .iter()
            .map(|(kind, n)| (format!("sidecar_{kind}"), *n))
            .chain([
                ("bots_lost_session".to_string(), b.errors),
                ("games_told".to_string(), arena_stats.errors_from_sidecar),
            ])
            .filter(|(_, n)| *n > 0)
            .collect(),
        kicks: b.kicks,
        logins_refused: b.refused_full,
        rtt_ms_p50: p.rtt_ms_p50,
        rtt_ms_p99: p.rtt_ms_p99,
        rtt_samples: p.rtt_samples,
        inputs_dropped_by_proxy: p.inputs_dropped,
        inputs_dropped_by_sidecars: s.inputs_dropped,
        inputs_undelivered,
        inputs_unaccounted,
        inputs_by_hop,
        ghosts_render: s.ghosts_render,
        ghosts_sim: s.ghosts_sim,
        subscriptions: s.subscriptions,
        routed_messages: s.routed_messages,
        cross_node_updates: s.cross_node_updates,
        dropped_unknown_account: s.dropped_unknown_account,
        handoffs: s.handoffs,
        handoffs_refused: s.handoffs_refused,
        commands_routed: s.commands_routed,
        commands_forwarded_on_handoff: s.commands_forwarded_on_handoff,
        command_results_ok: s.command_results_ok,
        command_results_failed: s.command_results_failed,
        claims_granted: s.claims_granted,
        claims_refused: s.claims_refused,
        trades_done: arena_stats.trades_done,
        trades_refused: arena_stats.trades_refused,
        trades_overlapping: games.trades().1,
        handoff_freeze_ms_p50: handoff_costs.freeze.value_at_quantile(0.5) as f64,
        handoff_freeze_ms_p99: handoff_costs.freeze.value_at_quantile(0.99) as f64,
        handoff_ticks_missed_p50: handoff_costs.ticks_missed.value_at_quantile(0.5) as f64,
        handoff_ticks_missed_p99: handoff_costs.ticks_missed.value_at_quantile(0.99) as f64,
        handoff_freeze_sidecars_ms_p50: handoff_costs.sidecars_ms.value_at_quantile(0.5) as f64,
        handoff_freeze_sidecars_ms_p99: handoff_costs.sidecars_ms.value_at_quantile(0.99) as f64,
        in_doubt_now,
        stale_epoch_drops: s.stale_epoch_drops,
        vanished_on_handoff: b.vanished_on_handoff,
        entities_alive: second.alive as u64,
        entities_lost: lost.len() as u64,
        entities_duplicated: duplicated.len() as u64,
        census_at_rest,
        checkpoint_writes: s.checkpoint_writes,
        checkpoints_stored: s.checkpoints_stored,
        checkpoint_stored_bytes: s.checkpoint_stored_bytes,
        checkpoint_writes_per_s_per_1000_entities: per_s_per_1000(
            s.checkpoint_writes,
            started.elapsed().as_secs_f64(),
            entities_peak,
        ),
        checkpoint_bytes_per_s_per_1000_entities: per_s_per_1000(
            s.checkpoint_stored_bytes,
            started.elapsed().as_secs_f64(),
            entities_peak,
        ),
        nodes_killed: kills.len() as u64,
        entities_restored: chaos.restored,
        restore_ms_p50: chaos.restore_ms.0,
        restore_ms_p99: chaos.restore_ms.1,
        progress_lost_ms_p50: chaos.progress_lost_ms.0,
        progress_lost_ms_p99: chaos.progress_lost_ms.1,
        sessions_kept: b.sessions_moved,
        sessions_dropped: b.errors,
        accounts_with_two_avatars,
        sessions_without_avatar,
        avatars_after_logout,
        geos: if geos.several() {
            geos.names.clone()
        } else {
            Vec::new()
        },
        bridged_sessions: bridged_peak,
        handovers: p.handovers,
        handover_reconnect_ms_p50: Percentiles::of(
            bot_stats
                .reconnect_ms
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
        .p50,
        hint_hits: p.hint_hits,
        cookie_hits: p.cookie_hits,
        mongo_reads_at_login: s.login_record_reads,
        probes_served: p.probes_served,
        handed_over_bots: handed_over.len(),
        handover_avatar_kept: bot_stats
            .handover_avatar_kept
            .load(std::sync::atomic::Ordering::Relaxed),
        handover_avatar_replaced: bot_stats
            .handover_avatar_replaced
            .load(std::sync::atomic::Ordering::Relaxed),
        handover_inventory_unseen: bot_stats
            .handover_inventory_unseen
            .load(std::sync::atomic::Ordering::Relaxed),
        handed_over_input_to_update_ms_before: Percentiles::of(
            handed_over.iter().map(|(b, _)| *b).collect(),
        )
        .p50,
        partition: if opts.bsp { "bsp" } else { "grid" }.into(),
        partition_epochs,
        balance_moves: directed.balance_moves,
        cells_added: directed.cells_added,
        cells_retired: directed.cells_retired,
        chunks_moved: directed.chunks_moved,
        load_max_over_avg: {
            let pct = Percentiles::of(spreads);
            LoadSpread {
                end: load_end,
                p50: pct.p50,
                p99: pct.p99,
                samples: pct.samples,
            }
        },
        handed_over_input_to_update_ms_after: Percentiles::of(
            handed_over.iter().map(|(_, a)| *a).collect(),
        )
        .p50,
        input_to_update_ms: bot_stats
            .click_to_screen
            .figures()
            .into_iter()
            .map(|(loc, f)| {
                let p = Percentiles {
                    p50: f.p50_ms,
                    p99: f.p99_ms,
                    samples: f.samples as usize,
                };
                (loc, p)
            })
            .collect(),
    };
    if let Some(path) = &opts.summary_json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &opts.svg {
        let subtitle = if geos.several() {
            format!(
                "geos {} · {}",
                geos.names.join(", "),
                geos.describe_delays()
            )
        } else {
            String::new()
        };
        let timeline = plot::Timeline {
            title: format!(
                "cellmesh up: click to screen by bot location, {} nodes, {} bots",
                opts.nodes, opts.bots
            ),
            subtitle,
            duration_s: summary.duration_s,
            click_to_screen: bot_stats.click_to_screen.series(),
            bridged: bridged_over_time,
            handovers: handover_marks,
            kills: kill_marks,
        };
        let svg = plot::render_svg(&timeline).context("drawing the run")?;
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(summary)
}

/// A loopback address nothing listens on now (bound and released), for a listener that others
/// must be able to name before it starts.
fn free_loopback_addr() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

/// The proxies' counters together (their RTT percentiles: the worst proxy's).
fn proxy_stats(proxies: &[cellmesh_proxy::ProxyHandle]) -> cellmesh_proxy::ProxyStats {
    let mut t = cellmesh_proxy::ProxyStats::default();
    for p in proxies {
        let s = p.stats();
        t.sessions += s.sessions;
        t.sessions_peak += s.sessions_peak;
        t.sessions_moved += s.sessions_moved;
        t.connections_refused += s.connections_refused;
        t.rtt_reports_dropped += s.rtt_reports_dropped;
        t.inputs_accepted += s.inputs_accepted;
        t.inputs_dropped += s.inputs_dropped;
        t.inputs_received += s.inputs_received;
        for (why, n) in s.inputs_lost {
            *t.inputs_lost.entry(why).or_insert(0) += n;
        }
        t.inputs_written += s.inputs_written;
        t.inputs_on_ended_links += s.inputs_on_ended_links;
        t.kicks += s.kicks;
        t.rtt_ms_p50 = t.rtt_ms_p50.max(s.rtt_ms_p50);
        t.rtt_ms_p99 = t.rtt_ms_p99.max(s.rtt_ms_p99);
        t.rtt_samples += s.rtt_samples;
        t.frames_in += s.frames_in;
        t.frames_out += s.frames_out;
        t.logins_refused += s.logins_refused;
        t.gateways_closed += s.gateways_closed;
        t.hint_hits += s.hint_hits;
        t.cookie_hits += s.cookie_hits;
        t.cookie_requests += s.cookie_requests;
        t.handovers += s.handovers;
        t.bridged_sessions += s.bridged_sessions;
        t.probes_served += s.probes_served;
    }
    t
}

/// The restore figures of a `--chaos` run.
#[derive(Debug, Default, PartialEq)]
struct ChaosFigures {
    restored: u64,
    /// (p50, p99) from the kill to the entity simulated again.
    restore_ms: (f64, f64),
    /// (p50, p99) of the kill less when the restored state was taken.
    progress_lost_ms: (f64, f64),
}

/// Each restore of a killed node's entity, against the latest kill of that node before it.
fn chaos_figures(
    kills: &[(u32, u64)],
    restored: &[cellmesh_sidecar::core::Restored],
) -> ChaosFigures {
    let mut restore = hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
    let mut lost = hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
    let mut n = 0;
    for r in restored {
        let Some(killed_at) = kills
            .iter()
            .filter(|(node, at)| *node == r.dead_node && *at <= r.restored_unix_ms)
            .map(|(_, at)| *at)
            .max()
        else {
            continue;
        };
        n += 1;
        let _ = restore.record(r.restored_unix_ms - killed_at);
        let _ = lost.record(killed_at.saturating_sub(r.state_unix_ms));
    }
    let q = |h: &hdrhistogram::Histogram<u64>| {
        if h.is_empty() {
            (0.0, 0.0)
        } else {
            (
                h.value_at_quantile(0.5) as f64,
                h.value_at_quantile(0.99) as f64,
            )
        }
    };
    ChaosFigures {
        restored: n,
        restore_ms: q(&restore),
        progress_lost_ms: q(&lost),
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A count over a run, per second and per 1,000 entities (0 for an empty or instant run).
fn per_s_per_1000(count: u64, seconds: f64, entities: u64) -> f64 {
    if seconds <= 0.0 || entities == 0 {
        return 0.0;
    }
    count as f64 / seconds / (entities as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn geo_delays_are_one_for_all_the_upper_triangle_or_the_cities_figures() {
        let three = names(&["paris", "montreal", "hongkong"]);
        let m = delay_matrix(&three, &[]).unwrap();
        assert_eq!(m, [[0, 45, 110], [45, 0, 120], [110, 120, 0]]);
        assert_eq!(
            delay_matrix(&three, &[30]).unwrap(),
            [[0, 30, 30], [30, 0, 30], [30, 30, 0]]
        );
        assert_eq!(
            delay_matrix(&three, &[10, 20, 30]).unwrap(),
            [[0, 10, 20], [10, 0, 30], [20, 30, 0]]
        );
        let e = delay_matrix(&three, &[10, 20]).unwrap_err().to_string();
        assert!(e.contains("or 3 for 3 geos"), "{e}");
        // Names it does not know: the default.
        let m = delay_matrix(&names(&["a", "paris"]), &[]).unwrap();
        assert_eq!(m[0][1], DEFAULT_ONE_WAY_MS);
        let layout = GeoLayout::new(&three, 4, &[]).unwrap();
        assert_eq!(
            layout.describe_delays(),
            "paris–montreal 45, paris–hongkong 110, montreal–hongkong 120 ms one way"
        );
        assert_eq!(
            layout.to_proxy(2, 0),
            cellmesh_proto::shaping::OneWay::ms(110, 3)
        );
    }

    #[test]
    fn costs_are_per_second_and_per_thousand_entities() {
        // 600 writes over 30 s for 300 entities: 20/s, 66.7/s per 1,000.
        let r = per_s_per_1000(600, 30.0, 300);
        assert!((r - 66.666).abs() < 0.01, "{r}");
        assert_eq!(per_s_per_1000(600, 0.0, 300), 0.0);
        assert_eq!(per_s_per_1000(600, 30.0, 0), 0.0);
    }

    fn clean(sent: u64) -> InputLedger {
        InputLedger {
            bots_sent: sent,
            proxy_received: sent,
            proxy_written: sent,
            sidecars_from_proxies: sent,
            delivered: sent,
            ..InputLedger::default()
        }
    }

    #[test]
    fn a_clean_run_leaves_nothing_undelivered() {
        assert_eq!(clean(100).undelivered(), (BTreeMap::new(), 0));
    }

    #[test]
    fn every_hop_names_its_losses() {
        let l = InputLedger {
            bots_sent: 100,
            bots_on_broken_sessions: 30,
            // 5 never read by the proxy, within the 30 sent on broken sessions.
            proxy_received: 95,
            proxy_rate_limited: 2,
            proxy_lost: [("link_closed", 3)].into_iter().collect(),
            // 90 written, 4 lost in a gateway link that broke.
            proxy_written: 90,
            proxy_on_ended_links: 40,
            sidecars_from_proxies: 86,
            // 20 forwarded: 1 never written, 2 lost in flight, 17 read by peers.
            sidecars_forwarded: 20,
            sidecars_lost_in_links: 1,
            sidecars_on_ended_links: 10,
            sidecars_from_peers: 17,
            sidecars_dropped: [("input_late", 1)].into_iter().collect(),
            // One input applied at its source after a refusal; its copy was one of the 2 lost.
            sidecars_copies_applied: 1,
            sidecars_copies_refused: 0,
            sidecars_held: 0,
            sidecars_held_by_killed: 0,
            delivered: 83,
        };
        let (by, unaccounted) = l.undelivered();
        let want: BTreeMap<String, u64> = [
            ("client_connection_broken", 5),
            ("proxy_rate_limited", 2),
            ("proxy_link_closed", 3),
            ("gateway_link_broken", 4),
            ("peer_link_closed", 1),
            ("peer_link_broken", 2),
            ("sidecar_input_late", 1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!((by, unaccounted), (want, 0));
    }

    #[test]
    fn a_gap_no_broken_connection_explains_stays_unaccounted() {
        // 3 inputs vanish between the proxy and the gateway, and no link broke.
        let mut l = clean(100);
        l.sidecars_from_proxies = 97;
        l.delivered = 97;
        assert_eq!(l.undelivered(), (BTreeMap::new(), 3));
        // Broken links explain at most what they carried.
        l.proxy_on_ended_links = 2;
        let (by, unaccounted) = l.undelivered();
        assert_eq!((by["gateway_link_broken"], unaccounted), (2, 1));
        // An input delivered twice shows as a negative remainder.
        let mut twice = clean(10);
        twice.delivered = 11;
        assert_eq!(twice.undelivered().1, -1);
        // A refused copy the target dropped balances the original applied at the source.
        let mut refused = clean(10);
        refused.sidecars_copies_applied = 1;
        refused.sidecars_copies_refused = 1;
        assert_eq!(refused.undelivered().1, 0);
    }

    #[test]
    fn inputs_held_at_the_end_explain_a_gap_up_to_its_size() {
        // 4 inputs never reached a game; a frozen entity's source holds 3 and its target holds
        // the copies of 2 of them: 5 held, but they name only the 4 missing.
        let mut l = clean(100);
        l.delivered = 96;
        l.sidecars_held = 5;
        let (by, unaccounted) = l.undelivered();
        assert_eq!((by["sidecar_held_at_end"], unaccounted), (4, 0));
        // Held inputs do not hide a double delivery.
        let mut twice = clean(10);
        twice.delivered = 11;
        twice.sidecars_held = 2;
        assert_eq!(twice.undelivered(), (BTreeMap::new(), -1));
    }

    #[test]
    fn inputs_held_by_killed_nodes_are_named_before_those_held_at_the_end() {
        let mut l = clean(100);
        l.delivered = 94;
        l.sidecars_held_by_killed = 4;
        l.sidecars_held = 5;
        let (by, unaccounted) = l.undelivered();
        assert_eq!(
            (
                by["sidecar_lost_with_node"],
                by["sidecar_held_at_end"],
                unaccounted
            ),
            (4, 2, 0)
        );
    }

    fn restored(node: u32, state: u64, at: u64) -> cellmesh_sidecar::core::Restored {
        cellmesh_sidecar::core::Restored {
            entity_id: at,
            dead_node: node,
            dead_lease_epoch: 1,
            owner: 2,
            state_unix_ms: state,
            restored_unix_ms: at,
        }
    }

    #[test]
    fn restores_are_timed_from_the_latest_kill_of_their_node() {
        // Node 4 killed at 1,000 and 5,000; node 3 at 3,000.
        let kills = [(4, 1_000), (3, 3_000), (4, 5_000)];
        let f = chaos_figures(
            &kills,
            &[
                restored(4, 400, 3_000), // 2,000 after the first kill of 4, 600 of progress lost
                restored(3, 2_500, 5_000), // 2,000 after the kill of 3, 500 lost
                restored(4, 4_900, 7_000), // 2,000 after the second kill of 4, 100 lost
                restored(2, 0, 7_000),   // a node never killed: not counted
            ],
        );
        assert_eq!(f.restored, 3);
        assert_eq!(f.restore_ms, (2_000.0, 2_000.0));
        assert_eq!(f.progress_lost_ms.1, 600.0);
    }

    #[test]
    fn grids_are_as_square_as_the_count_allows() {
        assert_eq!(grid_shape(1), (1, 1));
        assert_eq!(grid_shape(2), (2, 1));
        assert_eq!(grid_shape(4), (2, 2));
        assert_eq!(grid_shape(6), (3, 2));
        assert_eq!(grid_shape(7), (7, 1));
    }
}
