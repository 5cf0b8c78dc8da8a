//! The virtual-time runner: one balancer round every `balance_period_ms`. Each round, the nodes
//! first apply the layouts their lag lets them have by now; each then reports the load of the
//! entities in the cell of the layout it applied (smoothed as the sidecar smooths it) with their
//! entity bound levels; the balancer decides, and a new layout is committed as the next epoch,
//! its chunks that change hands counted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::Serialize;

use cellmesh_world::balance::{Balancer, CellReport, Decision, EntityBoundLevels, Reason};
use cellmesh_world::geometry::{ChunkPos, ChunkRect};
use cellmesh_world::partition::{
    Axis, Bsp, BspEntryKind, BspTree, Layout, NodeId, Partition, PartitionError, Transfer,
};

use super::scenario::{Retired, Scenario};

/// The max/avg load the summary measures convergence against.
pub const BALANCED_RATIO: f64 = 1.3;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The balancer proposed a layout that is not a valid BSP of the world: a balancer bug.
    #[error("epoch {epoch}: the balancer's layout is not valid: {error}")]
    Layout { epoch: u64, error: PartitionError },
}

/// Everything a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub summary: Summary,
    /// Decisions worth reading: every line move, every change of a line's reason to hold, and
    /// every cell added, retiring, called off or deleted.
    pub timeline: Vec<TimelineEntry>,
    /// Every layout, the first included, with the chunks that changed hands to reach it.
    pub epochs: Vec<EpochEntry>,
    pub cell_events: Vec<CellEvent>,
    pub series: Series,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub scenario: String,
    pub duration_s: f64,
    pub chunks: (i64, i64),
    pub balance_period_ms: u64,
    pub rounds: u64,
    /// Layouts committed after the first.
    pub epochs: u64,
    /// Line moves, and by reason (`gain`, `retiring`).
    pub line_moves: u64,
    pub moves_by_reason: BTreeMap<String, u64>,
    /// Line decisions that held, by reason.
    pub holds_by_reason: BTreeMap<String, u64>,
    /// Moves that went the other way from the line's move the round before.
    pub reversals: u64,
    /// The lowest aggression any line had.
    pub min_aggression: f64,
    pub cells_added: u64,
    pub cells_retired: u64,
    pub retirements_called_off: u64,
    pub cells_deleted: u64,
    /// Chunks that changed hands over the run: each is a mass handoff.
    pub chunks_moved: i64,
    pub max_chunks_moved_in_an_epoch: i64,
    /// The most loaded cell over the average, as the balancer sees them (smoothed reports; the
    /// average over cells not retiring).
    pub max_over_avg_start: Option<f64>,
    pub max_over_avg_end: Option<f64>,
    pub max_over_avg_p50: Option<f64>,
    pub max_over_avg_peak: Option<f64>,
    /// Rounds from the first over [`BALANCED_RATIO`] to the first back at or under it.
    pub rounds_to_balanced: Option<u64>,
    /// From when max/avg stays at or under [`BALANCED_RATIO`] to the end.
    pub balanced_from_s: Option<f64>,
    pub avg_load_end: f64,
    pub max_load_end: f64,
    pub safety_bound_end: f64,
    pub nodes: Vec<NodeSummary>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSummary {
    pub node: NodeId,
    pub joined_s: f64,
    /// `cell`, `retiring`, `spare` or `exited`, at the end.
    pub state: String,
    /// Chunks of its cell in the last layout.
    pub chunks: i64,
    pub load_end: f64,
    pub entities_end: u32,
    /// Mean load over the rounds it ran.
    pub load_mean: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineEntry {
    pub at_s: f64,
    /// The epoch the round read.
    pub epoch: u64,
    #[serde(flatten)]
    pub decision: Decision,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochEntry {
    pub epoch: u64,
    pub at_s: f64,
    /// `initial`, `lines`, `cell_added` or `cell_deleted`.
    pub cause: &'static str,
    pub chunks_moved: i64,
    pub transfers: Vec<Transfer>,
    pub layout: BspTree,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellEvent {
    pub at_s: f64,
    /// `added`, `retiring`, `retire_called_off` or `deleted`.
    pub kind: &'static str,
    pub node: NodeId,
    /// For `added`: the cell it was split from.
    pub beside: Option<NodeId>,
}

impl CellEvent {
    /// `+n5 beside n1`, `retire n3`, …
    pub fn label(&self) -> String {
        match (self.kind, self.beside) {
            ("added", Some(b)) => format!("+n{} beside n{b}", self.node),
            ("retiring", _) => format!("retire n{}", self.node),
            ("retire_called_off", _) => format!("keep n{}", self.node),
            ("deleted", _) => format!("delete n{}", self.node),
            _ => format!("{} n{}", self.kind, self.node),
        }
    }
}

/// Sampled every round, for plots and for machines.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Series {
    pub t_s: Vec<f64>,
    pub nodes: Vec<NodeSeries>,
    pub avg_load: Vec<f64>,
    pub max_load: Vec<f64>,
    pub safety_bound: Vec<f64>,
    pub max_over_avg: Vec<Option<f64>>,
    pub lines: Vec<LineSeries>,
    pub crowds: Vec<CrowdSeries>,
}

/// Where a crowd's centre is (chunks), while it stands gathered.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CrowdSeries {
    pub name: String,
    pub x: Vec<Option<f64>>,
    pub y: Vec<Option<f64>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NodeSeries {
    pub node: NodeId,
    /// Its smoothed load as it reported it; `None` while it does not run.
    pub load: Vec<Option<f64>>,
    pub entities: Vec<Option<u32>>,
}

/// One split line, named by its place in the tree (`l`/`h` per level; the root is empty) and its
/// axis. A cell deleted beside a line's parent moves it up the tree: it then goes on under its
/// new name.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LineSeries {
    pub path: String,
    pub axis: Option<Axis>,
    /// The cells on each side, the last time it existed.
    pub low: Vec<NodeId>,
    pub high: Vec<NodeId>,
    /// Where it is after each round (chunks along its axis); `None` while it does not exist.
    pub at: Vec<Option<i64>>,
    pub aggression: Vec<Option<f64>>,
}

impl LineSeries {
    /// `y line (root): 1 2 | 3 4`.
    pub fn label(&self) -> String {
        let axis = self.axis.map_or("?".to_string(), |a| a.to_string());
        let path = if self.path.is_empty() {
            "root"
        } else {
            &self.path
        };
        let names = |v: &[NodeId]| {
            v.iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "{axis} line ({path}): {} | {}",
            names(&self.low),
            names(&self.high)
        )
    }
}

/// A node as the simulation runs it.
struct Running {
    applied: u64,
    smoothed: f64,
    entities: u32,
    load_sum: f64,
    rounds: u64,
}

/// A committed layout, with its cells at hand.
struct Committed {
    at_ms: u64,
    tree: BspTree,
    cells: HashMap<NodeId, ChunkRect>,
}

fn cells_of(bsp: &Bsp) -> HashMap<NodeId, ChunkRect> {
    bsp.entries()
        .filter_map(|e| match e.kind {
            BspEntryKind::Leaf { node } => Some((node, e.rect)),
            BspEntryKind::Split { .. } => None,
        })
        .collect()
}

/// One line of a tree: path, axis, position, nodes below and above.
type LineAt = (String, Axis, i64, Vec<NodeId>, Vec<NodeId>);

/// Every line of `tree`.
fn lines_of(tree: &BspTree) -> Vec<LineAt> {
    fn nodes(t: &BspTree, out: &mut Vec<NodeId>) {
        match t {
            BspTree::Leaf { node } => out.push(*node),
            BspTree::Split { low, high, .. } => {
                nodes(low, out);
                nodes(high, out);
            }
        }
    }
    fn walk(t: &BspTree, path: String, out: &mut Vec<LineAt>) {
        if let BspTree::Split {
            axis,
            at,
            low,
            high,
        } = t
        {
            let (mut l, mut h) = (Vec::new(), Vec::new());
            nodes(low, &mut l);
            nodes(high, &mut h);
            out.push((path.clone(), *axis, *at, l, h));
            walk(low, format!("{path}l"), out);
            walk(high, format!("{path}h"), out);
        }
    }
    let mut out = Vec::new();
    walk(tree, String::new(), &mut out);
    out
}

fn percentile(mut v: Vec<f64>, p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let k = ((v.len() - 1) as f64 * p).round() as usize;
    Some(v[k])
}

/// Runs a scenario to its end. Deterministic: the same scenario gives the same report.
pub fn run(s: &Scenario) -> Result<Report, SimError> {
    let cfg = &s.balance;
    let period = cfg.balance_period_ms;
    let (cx, cy) = s.chunks;
    let first =
        Bsp::even(&s.shape, &s.initial).map_err(|error| SimError::Layout { epoch: 1, error })?;
    let mut layouts: BTreeMap<u64, Committed> = BTreeMap::new();
    layouts.insert(
        1,
        Committed {
            at_ms: 0,
            tree: first.tree(),
            cells: cells_of(&first),
        },
    );
    let mut partition = Partition::new(s.shape, 1, Layout::Bsp(first.clone()))
        .map_err(|error| SimError::Layout { epoch: 1, error })?;
    let mut epoch = 1u64;
    let mut epochs = vec![EpochEntry {
        epoch: 1,
        at_s: 0.0,
        cause: "initial",
        chunks_moved: 0,
        transfers: Vec::new(),
        layout: first.tree(),
    }];
    let mut balancer = Balancer::new(cfg.clone());
    let mut live: BTreeMap<NodeId, Running> = BTreeMap::new();
    let mut exited: BTreeSet<NodeId> = BTreeSet::new();
    let mut joined_ms: BTreeMap<NodeId, u64> = s.initial.iter().map(|n| (*n, 0)).collect();
    for n in &s.initial {
        live.insert(
            *n,
            Running {
                applied: 1,
                smoothed: 0.0,
                entities: 0,
                load_sum: 0.0,
                rounds: 0,
            },
        );
    }
    let all_nodes: Vec<NodeId> = s
        .initial
        .iter()
        .copied()
        .chain(s.spares.iter().map(|(n, _)| *n))
        .collect();
    let mut series = Series {
        nodes: all_nodes
            .iter()
            .map(|n| NodeSeries {
                node: *n,
                ..NodeSeries::default()
            })
            .collect(),
        crowds: s
            .crowds
            .iter()
            .map(|c| CrowdSeries {
                name: c.name.clone(),
                ..CrowdSeries::default()
            })
            .collect(),
        ..Series::default()
    };
    let mut line_index: HashMap<(String, Axis), usize> = HashMap::new();
    let mut timeline = Vec::new();
    let mut cell_events = Vec::new();
    let mut last_reason: HashMap<String, Reason> = HashMap::new();
    let mut summary_counts = Counts::default();
    let mut grid = vec![0u32; (cx * cy) as usize];
    // The sidecar covers `smoothing_bias` of the way each second: per round, its power.
    let alpha = 1.0 - (1.0 - s.smoothing_bias).powf(period as f64 / 1000.0);

    let rounds = s.duration_ms / period + 1;
    for k in 0..rounds {
        let t_ms = k * period;
        let t_s = t_ms as f64 / 1000.0;
        for &(node, join) in &s.spares {
            if join <= t_ms
                && !live.contains_key(&node)
                && !exited.contains(&node)
                && !joined_ms.contains_key(&node)
            {
                joined_ms.insert(node, t_ms);
                // A node starts from the layout committed when it joins.
                live.insert(
                    node,
                    Running {
                        applied: epoch,
                        smoothed: 0.0,
                        entities: 0,
                        load_sum: 0.0,
                        rounds: 0,
                    },
                );
            }
        }
        for (node, r) in live.iter_mut() {
            let lag = s.lag_ms[node];
            if let Some((&e, _)) = layouts
                .range(r.applied + 1..)
                .rev()
                .find(|(_, c)| c.at_ms + lag <= t_ms)
            {
                r.applied = e;
            }
        }

        s.grid_at(t_ms, &mut grid);
        let mut reports = BTreeMap::new();
        for (node, r) in live.iter_mut() {
            let rect = layouts[&r.applied]
                .cells
                .get(node)
                .copied()
                .unwrap_or_default();
            let mut chunks = Vec::new();
            for y in rect.y0..rect.y1 {
                for x in rect.x0..rect.x1 {
                    let n = grid[(y * cx + x) as usize];
                    if n > 0 {
                        chunks.push((ChunkPos { x, y }, n));
                    }
                }
            }
            let entities: u32 = chunks.iter().map(|(_, n)| n).sum();
            let sample = f64::from(entities) * s.cost_per_entity;
            // A node's first report is its load as it stands: the world was running before the
            // scenario's first round, and a spare that joins holds nothing.
            if r.rounds == 0 {
                r.smoothed = sample;
            }
            r.smoothed += alpha * (sample - r.smoothed);
            r.entities = entities;
            r.load_sum += r.smoothed;
            r.rounds += 1;
            // As the sidecar does: the smoothed load spread evenly over the entities held.
            let per_entity = if entities == 0 {
                0.0
            } else {
                r.smoothed / f64::from(entities)
            };
            reports.insert(
                *node,
                CellReport {
                    load: r.smoothed,
                    entities,
                    rect,
                    levels: EntityBoundLevels::measure(rect, chunks, per_entity),
                    ghost_chunks: s.ghost_chunks,
                    partition_epoch: r.applied,
                },
            );
        }
        let tree = layouts[&epoch].tree.clone();
        let in_tree: Vec<NodeId> = {
            let mut v: Vec<NodeId> = layouts[&epoch].cells.keys().copied().collect();
            v.sort_unstable();
            v
        };
        let spares: Vec<NodeId> = live
            .keys()
            .copied()
            .filter(|n| !in_tree.contains(n))
            .collect();

        let round = balancer.round(t_ms, epoch, &tree, s.chunks, &reports, &spares);

        // What the round read: the most loaded cell over the balancer's average.
        let max_load = in_tree
            .iter()
            .map(|n| reports.get(n).map_or(0.0, |r| r.load))
            .fold(0.0, f64::max);
        series.t_s.push(t_s);
        series.avg_load.push(round.avg_load);
        series.max_load.push(max_load);
        series.safety_bound.push(round.safety_bound);
        series
            .max_over_avg
            .push((round.avg_load > 1e-9).then(|| max_load / round.avg_load));
        for (c, cs) in s.crowds.iter().zip(&mut series.crowds) {
            let at = c.gathered_at(t_ms).then(|| c.centre_at(&s.shape, t_ms));
            cs.x.push(at.map(|p| p.x));
            cs.y.push(at.map(|p| p.y));
        }
        for ns in &mut series.nodes {
            let r = live.get(&ns.node);
            ns.load.push(r.map(|r| r.smoothed));
            ns.entities.push(r.map(|r| r.entities));
        }

        let mut cause = "lines";
        for d in &round.decisions {
            let keep = match d {
                Decision::Line {
                    path,
                    from,
                    to,
                    line,
                    ..
                } => {
                    summary_counts.min_aggression =
                        summary_counts.min_aggression.min(line.aggression);
                    summary_counts.reversals += u64::from(line.reversal);
                    let by = if from != to {
                        summary_counts.line_moves += 1;
                        &mut summary_counts.moves_by_reason
                    } else {
                        &mut summary_counts.holds_by_reason
                    };
                    *by.entry(line.reason.as_str().to_string()).or_default() += 1;
                    let changed =
                        last_reason.insert(path.clone(), line.reason) != Some(line.reason);
                    from != to || changed
                }
                Decision::CellAdded { node, beside } => {
                    cause = "cell_added";
                    summary_counts.cells_added += 1;
                    cell_events.push(CellEvent {
                        at_s: t_s,
                        kind: "added",
                        node: *node,
                        beside: Some(*beside),
                    });
                    true
                }
                // Only after a failover, which this world does not simulate.
                Decision::CellReassigned { node, from } => {
                    cause = "cell_added";
                    cell_events.push(CellEvent {
                        at_s: t_s,
                        kind: "reassigned",
                        node: *node,
                        beside: Some(*from),
                    });
                    true
                }
                Decision::RetireStarted { node } => {
                    summary_counts.cells_retired += 1;
                    cell_events.push(CellEvent {
                        at_s: t_s,
                        kind: "retiring",
                        node: *node,
                        beside: None,
                    });
                    true
                }
                Decision::RetireCancelled { node } => {
                    summary_counts.called_off += 1;
                    cell_events.push(CellEvent {
                        at_s: t_s,
                        kind: "retire_called_off",
                        node: *node,
                        beside: None,
                    });
                    true
                }
                Decision::CellDeleted { node } => {
                    cause = "cell_deleted";
                    summary_counts.cells_deleted += 1;
                    cell_events.push(CellEvent {
                        at_s: t_s,
                        kind: "deleted",
                        node: *node,
                        beside: None,
                    });
                    if s.retired == Retired::Exit {
                        live.remove(node);
                        exited.insert(*node);
                    }
                    true
                }
            };
            if keep {
                timeline.push(TimelineEntry {
                    at_s: t_s,
                    epoch,
                    decision: d.clone(),
                });
            }
        }
        if matches!(cause, "cell_added" | "cell_deleted") {
            // The tree changed shape: lines are named anew.
            last_reason.clear();
        }

        if let Some(next) = round.layout {
            let bsp = Bsp::new(&s.shape, &next).map_err(|error| SimError::Layout {
                epoch: epoch + 1,
                error,
            })?;
            let successor = partition
                .successor(Layout::Bsp(bsp.clone()))
                .map_err(|error| SimError::Layout {
                    epoch: epoch + 1,
                    error,
                })?;
            let transfers = partition
                .diff(&successor)
                .map_err(|error| SimError::Layout {
                    epoch: epoch + 1,
                    error,
                })?;
            let moved: i64 = transfers.iter().map(|t| t.area.area()).sum();
            epoch += 1;
            partition = successor;
            layouts.insert(
                epoch,
                Committed {
                    at_ms: t_ms,
                    cells: cells_of(&bsp),
                    tree: next.clone(),
                },
            );
            epochs.push(EpochEntry {
                epoch,
                at_s: t_s,
                cause,
                chunks_moved: moved,
                transfers,
                layout: next,
            });
        }

        // Lines after the round, as committed.
        let rows = k as usize;
        for (path, axis, at, low, high) in lines_of(&layouts[&epoch].tree) {
            let i = *line_index.entry((path.clone(), axis)).or_insert_with(|| {
                series.lines.push(LineSeries {
                    path: path.clone(),
                    axis: Some(axis),
                    ..LineSeries::default()
                });
                series.lines.len() - 1
            });
            let l = &mut series.lines[i];
            l.at.resize(rows, None);
            l.aggression.resize(rows, None);
            l.at.push(Some(at));
            l.aggression
                .push(balancer.line(&path).map(|st| st.aggression));
            l.low = low;
            l.high = high;
        }
        for l in &mut series.lines {
            l.at.resize(rows + 1, None);
            l.aggression.resize(rows + 1, None);
        }
    }

    let last = layouts[&epoch].cells.clone();
    let nodes = all_nodes
        .iter()
        .filter_map(|n| {
            let joined = *joined_ms.get(n)?;
            let r = live.get(n);
            let state = match (r, last.get(n)) {
                (None, _) => "exited",
                (Some(_), None) => "spare",
                (Some(_), Some(_)) if balancer.cells().get(n).is_some_and(|c| c.retiring) => {
                    "retiring"
                }
                (Some(_), Some(_)) => "cell",
            };
            Some(NodeSummary {
                node: *n,
                joined_s: joined as f64 / 1000.0,
                state: state.into(),
                chunks: last.get(n).map_or(0, |r| r.area()),
                load_end: r.map_or(0.0, |r| r.smoothed),
                entities_end: r.map_or(0, |r| r.entities),
                load_mean: r.map_or(0.0, |r| r.load_sum / r.rounds.max(1) as f64),
            })
        })
        .collect();

    let ratios: Vec<f64> = series.max_over_avg.iter().flatten().copied().collect();
    let over = series
        .max_over_avg
        .iter()
        .position(|r| r.is_some_and(|r| r > BALANCED_RATIO));
    let rounds_to_balanced = over.and_then(|i| {
        series.max_over_avg[i..]
            .iter()
            .position(|r| r.is_some_and(|r| r <= BALANCED_RATIO))
            .map(|d| d as u64)
    });
    let tail_over = series
        .max_over_avg
        .iter()
        .rposition(|r| r.is_none_or(|r| r > BALANCED_RATIO));
    let balanced_from_s = match tail_over {
        None => Some(0.0),
        Some(i) => series.t_s.get(i + 1).copied(),
    };
    let c = summary_counts;
    let summary = Summary {
        scenario: s.name.clone(),
        duration_s: s.duration_ms as f64 / 1000.0,
        chunks: s.chunks,
        balance_period_ms: period,
        rounds,
        epochs: epoch - 1,
        line_moves: c.line_moves,
        moves_by_reason: c.moves_by_reason,
        holds_by_reason: c.holds_by_reason,
        reversals: c.reversals,
        min_aggression: c.min_aggression,
        cells_added: c.cells_added,
        cells_retired: c.cells_retired,
        retirements_called_off: c.called_off,
        cells_deleted: c.cells_deleted,
        chunks_moved: epochs.iter().map(|e| e.chunks_moved).sum(),
        max_chunks_moved_in_an_epoch: epochs.iter().map(|e| e.chunks_moved).max().unwrap_or(0),
        max_over_avg_start: series.max_over_avg.first().copied().flatten(),
        max_over_avg_end: series.max_over_avg.last().copied().flatten(),
        max_over_avg_p50: percentile(ratios.clone(), 0.5),
        max_over_avg_peak: ratios.iter().copied().reduce(f64::max),
        rounds_to_balanced,
        balanced_from_s,
        avg_load_end: series.avg_load.last().copied().unwrap_or(0.0),
        max_load_end: series.max_load.last().copied().unwrap_or(0.0),
        safety_bound_end: series.safety_bound.last().copied().unwrap_or(0.0),
        nodes,
    };
    Ok(Report {
        summary,
        timeline,
        epochs,
        cell_events,
        series,
    })
}

struct Counts {
    line_moves: u64,
    moves_by_reason: BTreeMap<String, u64>,
    holds_by_reason: BTreeMap<String, u64>,
    reversals: u64,
    min_aggression: f64,
    cells_added: u64,
    cells_retired: u64,
    called_off: u64,
    cells_deleted: u64,
}

impl Default for Counts {
    fn default() -> Self {
        Self {
            line_moves: 0,
            moves_by_reason: BTreeMap::new(),
            holds_by_reason: BTreeMap::new(),
            reversals: 0,
            min_aggression: 1.0,
            cells_added: 0,
            cells_retired: 0,
            called_off: 0,
            cells_deleted: 0,
        }
    }
}

/// `hh:mm:ss`.
fn clock(t_s: f64) -> String {
    let t = t_s.round() as u64;
    format!("{:02}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
}

fn opt(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

/// Timeline lines printed at most; the JSON has them all.
const MAX_TEXT_TIMELINE: usize = 200;

impl Report {
    pub fn render_text(&self) -> String {
        let s = &self.summary;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "scenario {:?}: {} s, {} × {} chunks, {} rounds of {} ms",
            s.scenario, s.duration_s, s.chunks.0, s.chunks.1, s.rounds, s.balance_period_ms
        );
        let _ = writeln!(o, "\ntimeline");
        for e in self.timeline.iter().take(MAX_TEXT_TIMELINE) {
            let what = match &e.decision {
                Decision::Line {
                    path,
                    axis,
                    from,
                    to,
                    line,
                } => {
                    let name = if path.is_empty() { "root" } else { path };
                    let rev = if line.reversal { ", reversal" } else { "" };
                    if from == to {
                        format!(
                            "{axis} line {name:<5} holds at {from:<4} {}",
                            line.reason.as_str()
                        )
                    } else {
                        format!(
                            "{axis} line {name:<5} {from:>4} → {to:<4} {}, aggression {:.2}{rev}",
                            line.reason.as_str(),
                            line.aggression
                        )
                    }
                }
                Decision::CellAdded { node, beside } => {
                    format!("cell added: node {node}, beside node {beside}")
                }
                Decision::RetireStarted { node } => format!("node {node}'s cell starts retiring"),
                Decision::RetireCancelled { node } => {
                    format!("node {node}'s retirement called off")
                }
                Decision::CellDeleted { node } => format!("node {node}'s cell deleted"),
                Decision::CellReassigned { node, from } => {
                    format!("node {node} takes a second cell of node {from}")
                }
            };
            let _ = writeln!(o, "  {}  epoch {:<4} {what}", clock(e.at_s), e.epoch);
        }
        if self.timeline.len() > MAX_TEXT_TIMELINE {
            let _ = writeln!(
                o,
                "  … {} more (--json has them all)",
                self.timeline.len() - MAX_TEXT_TIMELINE
            );
        }
        let _ = writeln!(o, "\nsummary");
        let by = |m: &BTreeMap<String, u64>| {
            if m.is_empty() {
                "none".to_string()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let _ = writeln!(
            o,
            "  epochs {}, line moves {} ({}), reversals {}, lowest aggression {:.3}",
            s.epochs,
            s.line_moves,
            by(&s.moves_by_reason),
            s.reversals,
            s.min_aggression
        );
        let _ = writeln!(o, "  line decisions that held: {}", by(&s.holds_by_reason));
        let _ = writeln!(
            o,
            "  cells added {}, retired {}, retirements called off {}, deleted {}",
            s.cells_added, s.cells_retired, s.retirements_called_off, s.cells_deleted
        );
        let _ = writeln!(
            o,
            "  chunks moved {} (most in one epoch {})",
            s.chunks_moved, s.max_chunks_moved_in_an_epoch
        );
        let _ = writeln!(
            o,
            "  max/avg load: start {}, end {}, p50 {}, peak {}",
            opt(s.max_over_avg_start),
            opt(s.max_over_avg_end),
            opt(s.max_over_avg_p50),
            opt(s.max_over_avg_peak)
        );
        let _ = writeln!(
            o,
            "  back to max/avg <= {BALANCED_RATIO} in {} rounds; stays there from {}",
            s.rounds_to_balanced
                .map_or("-".to_string(), |r| r.to_string()),
            s.balanced_from_s.map_or("never".to_string(), clock)
        );
        let _ = writeln!(
            o,
            "  at the end: average load {:.3}, most loaded cell {:.3}, safety bound {:.3}",
            s.avg_load_end, s.max_load_end, s.safety_bound_end
        );
        let _ = writeln!(o, "\nnodes");
        let _ = writeln!(
            o,
            "  {:>4}  {:>8}  {:<8}  {:>6}  {:>8}  {:>8}  {:>9}",
            "node", "joined", "state", "chunks", "load", "entities", "mean load"
        );
        for n in &s.nodes {
            let _ = writeln!(
                o,
                "  {:>4}  {:>8}  {:<8}  {:>6}  {:>8.3}  {:>8}  {:>9.3}",
                n.node,
                clock(n.joined_s),
                n.state,
                n.chunks,
                n.load_end,
                n.entities_end,
                n.load_mean
            );
        }
        o
    }
}
