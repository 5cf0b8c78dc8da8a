//! The director in the simulator: the real [`DirectorCore`] in virtual time, its store calls
//! answered by the simulated topology store. The store keeps the director's lease here (by true
//! time, with the rules of the real stores) and each node's latest load report; it commits a
//! layout through the simulator's own partition commit, which the nodes apply by mass handoff.
//! What the director did, and how even the nodes' loads were meanwhile, is kept for the report:
//! the simulator's observation, not the director's logic.

use std::collections::BTreeMap;
use std::time::Duration;

use cellmesh_director::config::BubbleConfig;
use cellmesh_director::{DirectorConfig, DirectorCore, Event, Metrics};
use cellmesh_stores::topology::{DirectorAcquire, DirectorLease};
use cellmesh_world::balance::{CellReport, Decision, LoadConfig};
use cellmesh_world::partition::{BspTree, NodeId};

use crate::Scenario;

/// The director process's lease holder name.
const HOLDER: &str = "sim-director";

pub(crate) struct Director {
    pub core: DirectorCore,
    /// The director's lease as the topology store holds it.
    lease: Option<DirectorLease>,
    /// Each live node's latest report, as the topology store keeps it (a node's death takes its
    /// report with its lease).
    pub reports: BTreeMap<NodeId, CellReport>,
    /// Each live node's latest players, kept alike.
    pub players: BTreeMap<NodeId, Vec<cellmesh_stores::topology::PlayerSample>>,
    /// The wake-up scheduled for the core, if any.
    pub wake_at: Option<u64>,
    pub figures: Balance,
}

impl Director {
    /// The scenario's director, if it runs one: a balancer, or a geo-aware director whose sites
    /// are the scenario's geos, core first.
    pub fn of(s: &Scenario) -> Option<Self> {
        if s.director.is_none() && s.bubbles.is_none() {
            return None;
        }
        let bubbles = s.bubbles.clone().map(|params| {
            let sites = s
                .geos
                .map(|g| g.names.iter().map(|n| n.to_string()).collect())
                .unwrap_or_default();
            let b = BubbleConfig { sites, params };
            b.validate()
                .expect("the scenario's bubbles: two geos or more, valid parameters");
            b
        });
        Some(Self::new(s.director.clone().unwrap_or_default(), bubbles))
    }

    fn new(balance: LoadConfig, bubbles: Option<BubbleConfig>) -> Self {
        let cfg = DirectorConfig {
            balance,
            bubbles,
            ..DirectorConfig::default()
        };
        Self {
            core: DirectorCore::new(cfg, HOLDER.into(), Metrics::new().0),
            lease: None,
            reports: BTreeMap::new(),
            players: BTreeMap::new(),
            wake_at: None,
            figures: Balance::default(),
        }
    }

    pub fn period_ms(&self) -> u64 {
        self.core.period_ms()
    }

    /// The store's `acquire_director` at store time `now_unix_ms`: granted if free, lapsed or
    /// already the holder's, under a new epoch.
    pub fn acquire(&mut self, now_unix_ms: u64, holder: &str, ttl: Duration) -> DirectorAcquire {
        if let Some(d) = self
            .lease
            .as_ref()
            .filter(|d| now_unix_ms < d.expires_unix_ms && d.holder != holder)
        {
            return DirectorAcquire::Held(d.clone());
        }
        let lease = DirectorLease {
            holder: holder.to_string(),
            epoch: self.lease.as_ref().map_or(0, |d| d.epoch) + 1,
            expires_unix_ms: now_unix_ms + ttl.as_millis() as u64,
        };
        self.lease = Some(lease.clone());
        DirectorAcquire::Granted(lease)
    }

    /// The store's lease if `lease` is it, current and live at `now_unix_ms`.
    fn live(&mut self, lease: &DirectorLease, now_unix_ms: u64) -> Option<&mut DirectorLease> {
        self.lease.as_mut().filter(|d| {
            d.holder == lease.holder && d.epoch == lease.epoch && now_unix_ms < d.expires_unix_ms
        })
    }

    pub fn renew(
        &mut self,
        now_unix_ms: u64,
        lease: &DirectorLease,
        ttl: Duration,
    ) -> Option<DirectorLease> {
        self.live(lease, now_unix_ms).map(|d| {
            d.expires_unix_ms = now_unix_ms + ttl.as_millis() as u64;
            d.clone()
        })
    }

    pub fn release(&mut self, now_unix_ms: u64, lease: &DirectorLease) -> bool {
        self.live(lease, now_unix_ms)
            .map(|d| d.expires_unix_ms = 0)
            .is_some()
    }

    /// Whether a commit under `lease` is the current director's; otherwise the store's lease.
    pub fn fence(
        &mut self,
        now_unix_ms: u64,
        lease: &DirectorLease,
    ) -> Result<(), Option<DirectorLease>> {
        match self.live(lease, now_unix_ms) {
            Some(_) => Ok(()),
            None => Err(self.lease.clone()),
        }
    }

    /// What the core did, as the report counts it.
    pub fn observe(&mut self, now: u64, event: Event) {
        let f = &mut self.figures;
        match event {
            Event::Round { decisions, .. } => {
                for d in &decisions {
                    *f.reasons.entry(reason(d)).or_default() += 1;
                }
            }
            // The store takes only a valid layout: one that is not is refused, and the director
            // balances on from the committed one.
            Event::LayoutRefused { layout, .. } => f.refused.push((now, layout)),
            Event::Committed {
                epoch,
                chunks_moved,
                decisions,
            } => f.epochs.push(EpochRecord {
                epoch,
                at_ms: now,
                chunks_moved,
                decisions,
            }),
            _ => {}
        }
    }
}

/// A decision's reason, as the report counts it.
fn reason(d: &Decision) -> &'static str {
    match d {
        Decision::Line { line, .. } => line.reason.as_str(),
        Decision::CellAdded { .. } => "cell_added",
        Decision::RetireStarted { .. } => "retire_started",
        Decision::RetireCancelled { .. } => "retire_cancelled",
        Decision::CellDeleted { .. } => "cell_deleted",
        Decision::CellReassigned { .. } => "cell_reassigned",
    }
}

/// One epoch the director committed.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochRecord {
    pub epoch: u64,
    pub at_ms: u64,
    /// Chunks that changed hands from the epoch before (`Partition::diff`).
    pub chunks_moved: i64,
    /// The round's decisions, each with its reason.
    pub decisions: Vec<Decision>,
}

/// How even the nodes were at one round: their real entities as the cores hold them (not as
/// reported), and the max/avg of both those counts and the reported loads.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at_ms: u64,
    /// Unfrozen reals per node owning a cell.
    pub entities: Vec<(NodeId, usize)>,
    pub max_over_avg: f64,
    pub reported_max_over_avg: f64,
}

/// What the director did over one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Balance {
    /// Rounds run (one per balance period while motion lasts).
    pub rounds: u64,
    /// One sample per round, before the round decides.
    pub samples: Vec<Sample>,
    pub epochs: Vec<EpochRecord>,
    /// Every round's line decisions by reason (`gain`, `entity_bound`, `stale`...), and the
    /// cells added, retired and deleted.
    pub reasons: BTreeMap<&'static str, u64>,
    /// Layouts the balancer yielded that are no valid BSP, so could not be committed (when,
    /// and the tree).
    pub refused: Vec<(u64, BspTree)>,
    /// Max/avg of the nodes' reals at the quiet end, once every handoff settled.
    pub end_max_over_avg: f64,
}

impl Balance {
    pub fn epochs_committed(&self) -> usize {
        self.epochs.len()
    }

    pub fn chunks_moved(&self) -> i64 {
        self.epochs.iter().map(|e| e.chunks_moved).sum()
    }

    /// The most uneven the nodes were before the director's first commit took effect (its
    /// rounds up to and including the first that committed).
    pub fn start_max_over_avg(&self) -> f64 {
        let first = self.epochs.first().map_or(u64::MAX, |e| e.at_ms);
        self.samples
            .iter()
            .filter(|s| s.at_ms <= first)
            .map(|s| s.max_over_avg)
            .fold(0.0, f64::max)
    }

    /// The first round (counted from 1) from which the nodes stay at or under `bound` for
    /// `hold` rounds in a row, if any.
    pub fn rounds_to(&self, bound: f64, hold: usize) -> Option<usize> {
        let ok: Vec<bool> = self
            .samples
            .iter()
            .map(|s| s.max_over_avg <= bound)
            .collect();
        (0..ok.len().saturating_sub(hold - 1))
            .find(|&i| ok[i..i + hold].iter().all(|b| *b))
            .map(|i| i + 1)
    }

    /// The largest max/avg over the rounds from `round` (counted from 1) on.
    pub fn worst_from(&self, round: usize) -> f64 {
        self.samples
            .iter()
            .skip(round.saturating_sub(1))
            .map(|s| s.max_over_avg)
            .fold(0.0, f64::max)
    }
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "balance: {} rounds, {} epochs committed, {} chunks moved, max/avg {:.2} -> {:.2} \
             (at or under 1.3 for 5 rounds from round {})",
            self.rounds,
            self.epochs_committed(),
            self.chunks_moved(),
            self.start_max_over_avg(),
            self.end_max_over_avg,
            self.rounds_to(1.3, 5)
                .map_or_else(|| "never".to_string(), |r| r.to_string()),
        )
    }
}

/// Max over average of `loads` (0 when they sum to nothing).
pub(crate) fn max_over_avg(loads: impl IntoIterator<Item = f64>) -> f64 {
    let loads: Vec<f64> = loads.into_iter().collect();
    let total: f64 = loads.iter().sum();
    if loads.is_empty() || total <= 0.0 {
        return 0.0;
    }
    loads.iter().copied().fold(0.0, f64::max) / (total / loads.len() as f64)
}

/// The balance figures of many seeds of one scenario, on one line: epochs committed, chunks
/// moved, max/avg at the start and at the quiet end, and the rounds to reach 1.3.
pub fn summarise(runs: &[&Balance]) -> String {
    if runs.is_empty() {
        return "balance: no runs".into();
    }
    let n = runs.len() as f64;
    let mean = |f: &dyn Fn(&Balance) -> f64| runs.iter().map(|b| f(b)).sum::<f64>() / n;
    let worst = |f: &dyn Fn(&Balance) -> f64| runs.iter().map(|b| f(b)).fold(0.0, f64::max);
    let epochs: Vec<usize> = runs.iter().map(|b| b.epochs_committed()).collect();
    let reached: Vec<usize> = runs.iter().filter_map(|b| b.rounds_to(1.3, 5)).collect();
    let range = |v: &[usize]| {
        format!(
            "{}..{}",
            v.iter().min().copied().unwrap_or(0),
            v.iter().max().copied().unwrap_or(0)
        )
    };
    format!(
        "balance: epochs committed {} (mean {:.1}), chunks moved {:.0} on average, max/avg \
         {:.2} -> {:.2} on average (worst end {:.2}); at or under 1.3 for 5 rounds from round {} \
         ({} of {} seeds never)",
        range(&epochs),
        mean(&|b| b.epochs_committed() as f64),
        mean(&|b| b.chunks_moved() as f64),
        mean(&|b| b.start_max_over_avg()),
        mean(&|b| b.end_max_over_avg),
        worst(&|b| b.end_max_over_avg),
        range(&reached),
        runs.len() - reached.len(),
        runs.len(),
    )
}

/// What a geo-aware director did over one run, and where the gathering (see
/// [`crate::scenario::Gathering`]) ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BubbleFigures {
    /// Placement rounds, and the most players one of them placed.
    pub placements: u64,
    pub most_placed: u64,
    /// Bubbles committed to another geo (one per bubble and epoch) and regions moved, as the
    /// director counts them.
    pub bubble_moves: u64,
    pub regions_moved: u64,
    /// When the gathering's region was first committed to a node of its players' geo.
    pub moved_at_ms: Option<u64>,
    /// Commits that gave the gathering's region to another node (there, and back).
    pub gathering_moves: u64,
    /// Deaths of nodes, and of those the deaths while a handoff was in flight somewhere.
    pub kills: u64,
    pub kills_mid_handoff: u64,
    /// The geo simulating the gathered players at the end, once the checks found them there.
    pub ended_in: Option<&'static str>,
}

impl std::fmt::Display for BubbleFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "bubbles: {} placements (at most {} players placed), {} bubble moves, {} regions \
             moved; the gathering's region moved to its geo at {}, moved {} times; {} kills \
             ({} with handoffs in flight); ended in {}",
            self.placements,
            self.most_placed,
            self.bubble_moves,
            self.regions_moved,
            self.moved_at_ms
                .map_or_else(|| "never".to_string(), |t| format!("{t} ms")),
            self.gathering_moves,
            self.kills,
            self.kills_mid_handoff,
            self.ended_in.unwrap_or("?"),
        )
    }
}
