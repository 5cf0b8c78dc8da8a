//! The director's Prometheus metrics.

use cellmesh_world::balance::Decision;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The director's counters and gauges; [`Metrics::new`] also returns the registry that shows them.
#[derive(Clone)]
pub struct Metrics {
    pub active: Gauge,
    pub leases_granted: Counter,
    pub leases_lost: Counter,
    pub rounds: Counter,
    pub partition_epoch: Gauge,
    pub epochs_committed: Counter,
    pub chunks_moved: Counter,
    pub bubble_moves: Counter,
    pub regions_moved: Counter,
    pub bubbles: Gauge,
    pub players_placed: Gauge,
    commits_refused: Family<KindLabels, Counter>,
    lines: Family<ReasonLabels, Counter>,
    cells: Family<KindLabels, Counter>,
    errors: Family<KindLabels, Counter>,
    pub avg_load: Gauge<f64, AtomicU64>,
    pub max_load: Gauge<f64, AtomicU64>,
    pub safety_bound: Gauge<f64, AtomicU64>,
}

impl Metrics {
    pub fn new() -> (Self, Registry) {
        let mut reg = Registry::with_prefix("cellmesh_director");
        let m = Self {
            active: Gauge::default(),
            leases_granted: Counter::default(),
            leases_lost: Counter::default(),
            rounds: Counter::default(),
            partition_epoch: Gauge::default(),
            epochs_committed: Counter::default(),
            chunks_moved: Counter::default(),
            bubble_moves: Counter::default(),
            regions_moved: Counter::default(),
            bubbles: Gauge::default(),
            players_placed: Gauge::default(),
            commits_refused: Family::default(),
            lines: Family::default(),
            cells: Family::default(),
            errors: Family::default(),
            avg_load: Gauge::default(),
            max_load: Gauge::default(),
            safety_bound: Gauge::default(),
        };
        reg.register(
            "active",
            "1 while this director holds the director's lease, 0 while it stands by",
            m.active.clone(),
        );
        reg.register(
            "leases_granted",
            "Director's leases granted to this director",
            m.leases_granted.clone(),
        );
        reg.register(
            "leases_lost",
            "Director's leases this director lost (lapsed, taken, or a commit fenced)",
            m.leases_lost.clone(),
        );
        reg.register(
            "rounds",
            "Balance rounds run while active",
            m.rounds.clone(),
        );
        reg.register(
            "partition_epoch",
            "The partition epoch as last read or committed",
            m.partition_epoch.clone(),
        );
        reg.register(
            "epochs_committed",
            "Layouts this director committed as a new partition epoch",
            m.epochs_committed.clone(),
        );
        reg.register(
            "chunks_moved",
            "Chunks that changed hands in the epochs this director committed (each a mass handoff)",
            m.chunks_moved.clone(),
        );
        reg.register(
            "bubble_moves",
            "Bubbles whose regions this director moved to another geo (one per bubble and epoch)",
            m.bubble_moves.clone(),
        );
        reg.register(
            "regions_moved",
            "Grid regions this director committed to a node of another geo for a bubble",
            m.regions_moved.clone(),
        );
        reg.register(
            "bubbles",
            "Bubbles (groups of players) in the last placement",
            m.bubbles.clone(),
        );
        reg.register(
            "players_placed",
            "Players in the last placement (those measured toward every available geo)",
            m.players_placed.clone(),
        );
        reg.register(
            "commits_refused",
            "Commits the store refused, by kind (stale: another commit came first; fenced: this director's lease was no longer current)",
            m.commits_refused.clone(),
        );
        reg.register(
            "line_decisions",
            "Split line decisions by reason (gain and retiring move the line; the others hold it)",
            m.lines.clone(),
        );
        reg.register(
            "cell_changes",
            "Cells added, retirements started or cancelled, retired cells deleted, and second cells (a failover's) given to a spare",
            m.cells.clone(),
        );
        reg.register(
            "errors",
            "Topology store or layout errors, by kind",
            m.errors.clone(),
        );
        reg.register(
            "average_load",
            "Average smoothed load of the cells that are not retiring (fraction of a tick budget)",
            m.avg_load.clone(),
        );
        reg.register(
            "max_load",
            "Highest smoothed load of a cell (fraction of a tick budget)",
            m.max_load.clone(),
        );
        reg.register(
            "safety_bound",
            "The round's safety bound: no line grows a side whose busiest cell is at or over it",
            m.safety_bound.clone(),
        );
        (m, reg)
    }

    pub(crate) fn refused(&self, kind: &'static str) {
        self.commits_refused
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    pub(crate) fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn decision(&self, d: &Decision) {
        let kind = match d {
            Decision::Line { line, .. } => {
                self.lines
                    .get_or_create(&ReasonLabels {
                        reason: line.reason.as_str(),
                    })
                    .inc();
                return;
            }
            Decision::CellAdded { .. } => "added",
            Decision::RetireStarted { .. } => "retire_started",
            Decision::RetireCancelled { .. } => "retire_cancelled",
            Decision::CellDeleted { .. } => "deleted",
            Decision::CellReassigned { .. } => "reassigned",
        };
        self.cells.get_or_create(&KindLabels { kind }).inc();
    }
}
