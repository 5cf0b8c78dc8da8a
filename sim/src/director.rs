//! The director in the simulator: it keeps each node's latest load report (as the topology store
//! does), runs the balancer every balance period over the committed BSP, and commits each layout
//! it yields as the next epoch, which the nodes apply by mass handoff. What it did, and how even
//! the nodes' loads were meanwhile, is kept for the report.

use std::collections::BTreeMap;

use cellmesh_world::balance::{Balancer, CellReport, Decision, LoadConfig};
use cellmesh_world::partition::{BspTree, NodeId};

pub(crate) struct Director {
    pub balancer: Balancer,
    /// Each live node's latest report (a node's death takes its report with its lease).
    pub reports: BTreeMap<NodeId, CellReport>,
    pub figures: Balance,
}

impl Director {
    pub fn new(cfg: LoadConfig) -> Self {
        Self {
            balancer: Balancer::new(cfg),
            reports: BTreeMap::new(),
            figures: Balance::default(),
        }
    }

    pub fn period_ms(&self) -> u64 {
        self.balancer.config().balance_period_ms
    }

    /// Counts a round's decisions by reason.
    pub fn count(&mut self, decisions: &[Decision]) {
        for d in decisions {
            let reason = match d {
                Decision::Line { line, .. } => line.reason.as_str(),
                Decision::CellAdded { .. } => "cell_added",
                Decision::RetireStarted { .. } => "retire_started",
                Decision::RetireCancelled { .. } => "retire_cancelled",
                Decision::CellDeleted { .. } => "cell_deleted",
                Decision::CellReassigned { .. } => "cell_reassigned",
            };
            *self.figures.reasons.entry(reason).or_default() += 1;
        }
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
