//! One world's balancing (BigWorld's `Space::loadBalance` with `metaLoadBalance`): each round
//! deletes the retired cells that are empty once every node has the layout where they hold
//! nothing, adds or retires a cell every meta period, and otherwise moves the lines top down. A
//! line moves only when every node on both sides applied the current epoch (their reports describe
//! the cells as they are). Each round yields at most one new layout, for the director to commit as
//! the next epoch.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::internal_node::{do_balance, LineDecision, LineState, Shrink, Side};
use super::{CellReport, CellState, EntityBoundLevels, LoadConfig};
use crate::geometry::ChunkRect;
use crate::partition::bsp::{halves, range};
use crate::partition::{Axis, BspTree, NodeId};

/// What one round decided, each item with its reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Decision {
    /// A line, named by its path from the root (`l`/`h` per level; the root is empty).
    Line {
        path: String,
        axis: Axis,
        from: i64,
        to: i64,
        #[serde(flatten)]
        line: LineDecision,
    },
    /// A spare node's cell starts with no area at the edge of the busiest cell.
    CellAdded {
        node: NodeId,
        beside: NodeId,
    },
    RetireStarted {
        node: NodeId,
    },
    RetireCancelled {
        node: NodeId,
    },
    /// A retired cell with no area and no entity left the tree.
    CellDeleted {
        node: NodeId,
    },
    /// A spare node takes one of the cells of a node that holds several (a failover gave it a
    /// dead node's cell): one cell a node again, each with a report that describes it.
    CellReassigned {
        node: NodeId,
        from: NodeId,
    },
}

/// A round's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Round {
    /// The layout to commit, if it changed.
    pub layout: Option<BspTree>,
    pub decisions: Vec<Decision>,
    pub avg_load: f64,
    pub safety_bound: f64,
}

/// The tree as the balancer works on it: each entry with its cell and what lies under it.
#[derive(Debug, Clone)]
enum Node {
    Leaf {
        node: NodeId,
        rect: ChunkRect,
    },
    Split {
        axis: Axis,
        at: i64,
        rect: ChunkRect,
        low: Box<Node>,
        high: Box<Node>,
    },
}

/// What a subtree carries.
#[derive(Debug, Clone, Default)]
struct Sum {
    cells: usize,
    retiring: usize,
    load: f64,
    max_load: f64,
    created: bool,
    /// Every cell's node applied the current epoch.
    current: bool,
    /// Every cell's node holds no other: its levels map its entities.
    mapped: bool,
    /// Every cell is retiring.
    all_retiring: bool,
    levels: EntityBoundLevels,
    ghost_chunks: i64,
}

impl Sum {
    fn avg(&self) -> f64 {
        self.load / (self.cells - self.retiring).max(1) as f64
    }
}

impl Node {
    fn build(tree: &BspTree, rect: ChunkRect) -> Self {
        match tree {
            BspTree::Leaf { node } => Node::Leaf { node: *node, rect },
            BspTree::Split {
                axis,
                at,
                low,
                high,
            } => {
                let (l, h) = halves(&rect, *axis, *at);
                Node::Split {
                    axis: *axis,
                    at: *at,
                    rect,
                    low: Box::new(Node::build(low, l)),
                    high: Box::new(Node::build(high, h)),
                }
            }
        }
    }

    fn tree(&self) -> BspTree {
        match self {
            Node::Leaf { node, .. } => BspTree::leaf(*node),
            Node::Split {
                axis,
                at,
                low,
                high,
                ..
            } => BspTree::split(*axis, *at, low.tree(), high.tree()),
        }
    }

    fn rect(&self) -> ChunkRect {
        match self {
            Node::Leaf { rect, .. } | Node::Split { rect, .. } => *rect,
        }
    }

    fn set_rect(&mut self, to: ChunkRect) {
        match self {
            Node::Leaf { rect, .. } => *rect = to,
            Node::Split {
                axis,
                at,
                rect,
                low,
                high,
            } => {
                *rect = to;
                let (l, h) = halves(&to, *axis, *at);
                low.set_rect(l);
                high.set_rect(h);
            }
        }
    }

    fn leaves(&self, out: &mut Vec<(NodeId, ChunkRect)>) {
        match self {
            Node::Leaf { node, rect } => out.push((*node, *rect)),
            Node::Split { low, high, .. } => {
                low.leaves(out);
                high.leaves(out);
            }
        }
    }

    /// The positions of the lines on `axis` inside this subtree.
    fn lines_on(&self, on: Axis, out: &mut Vec<i64>) {
        if let Node::Split {
            axis,
            at,
            low,
            high,
            ..
        } = self
        {
            if *axis == on {
                out.push(*at);
            }
            low.lines_on(on, out);
            high.lines_on(on, out);
        }
    }

    fn sum(&self, world: &World) -> Sum {
        match self {
            Node::Leaf { node, rect } => {
                let report = world.reports.get(node);
                let state = world.cells.get(node);
                // A node holding several cells weighs its whole load in each: its one report
                // cannot say how the load splits, and counting it whole keeps the lines from
                // growing the node (while it cannot shrink either: `mapped`).
                let mapped = world.held.get(node).is_none_or(|h| *h <= 1);
                let load = report.map_or(0.0, |r| r.load);
                let retiring = state.is_some_and(|s| s.retiring);
                // The report describes this cell only if the node applied this epoch and no line
                // moved it earlier this round.
                // (A node holding several cells reports none of them: applying the epoch is all
                // it can say, and its side will not shrink.)
                let current = report.is_some_and(|r| {
                    r.partition_epoch >= world.epoch && (!mapped || r.rect == *rect)
                });
                let levels = match report {
                    Some(r) if current && mapped => r.levels.clone(),
                    _ => EntityBoundLevels::measure(*rect, [], 0.0),
                };
                Sum {
                    cells: 1,
                    retiring: usize::from(retiring),
                    load,
                    max_load: load,
                    created: state.is_some_and(|s| s.created(report)),
                    current,
                    mapped,
                    all_retiring: retiring,
                    levels,
                    ghost_chunks: report.map_or(0, |r| r.ghost_chunks),
                }
            }
            Node::Split {
                axis, low, high, ..
            } => {
                let (l, h) = (low.sum(world), high.sum(world));
                let width = |r: ChunkRect| {
                    let (a, b) = range(&r, *axis);
                    b - a
                };
                Sum {
                    cells: l.cells + h.cells,
                    retiring: l.retiring + h.retiring,
                    load: l.load + h.load,
                    max_load: l.max_load.max(h.max_load),
                    created: l.created && h.created,
                    current: l.current && h.current,
                    mapped: l.mapped && h.mapped,
                    all_retiring: l.all_retiring && h.all_retiring,
                    levels: EntityBoundLevels::merge(
                        &l.levels,
                        &h.levels,
                        *axis,
                        width(low.rect()),
                        width(high.rect()),
                    ),
                    ghost_chunks: l.ghost_chunks.min(h.ghost_chunks),
                }
            }
        }
    }
}

/// What a round reads.
struct World<'a> {
    epoch: u64,
    reports: &'a BTreeMap<NodeId, CellReport>,
    cells: &'a BTreeMap<NodeId, CellState>,
    /// How many leaves each node holds (more than one only after a failover).
    held: &'a BTreeMap<NodeId, usize>,
}

/// The balancer of one world: its lines' aggression and its cells' states, kept between rounds.
#[derive(Debug, Clone)]
pub struct Balancer {
    cfg: LoadConfig,
    lines: HashMap<String, LineState>,
    cells: BTreeMap<NodeId, CellState>,
    last_meta_ms: Option<u64>,
}

impl Balancer {
    pub fn new(cfg: LoadConfig) -> Self {
        Self {
            cfg,
            lines: HashMap::new(),
            cells: BTreeMap::new(),
            last_meta_ms: None,
        }
    }

    pub fn config(&self) -> &LoadConfig {
        &self.cfg
    }

    /// The cells' states (for display and tests).
    pub fn cells(&self) -> &BTreeMap<NodeId, CellState> {
        &self.cells
    }

    /// A line's state by its path.
    pub fn line(&self, path: &str) -> Option<&LineState> {
        self.lines.get(path)
    }

    /// One round at `now_ms` over the layout `tree` of epoch `epoch` (covering `chunks_x` ×
    /// `chunks_y`), with the nodes' reports and the spare nodes (running, holding no cell).
    pub fn round(
        &mut self,
        now_ms: u64,
        epoch: u64,
        tree: &BspTree,
        chunks: (i64, i64),
        reports: &BTreeMap<NodeId, CellReport>,
        spares: &[NodeId],
    ) -> Round {
        let mut root = Node::build(tree, ChunkRect::new(0, 0, chunks.0, chunks.1));
        let mut leaves = Vec::new();
        root.leaves(&mut leaves);
        // Cells the director did not make (the layout it started from) exist since epoch 0.
        self.cells
            .retain(|n, _| leaves.iter().any(|(node, _)| node == n));
        for (node, _) in &leaves {
            self.cells.entry(*node).or_insert(CellState {
                since_epoch: 0,
                retiring: false,
            });
        }
        // A node that holds a cell is no spare, whatever the caller thought.
        let spares: Vec<NodeId> = spares
            .iter()
            .filter(|s| !leaves.iter().any(|(n, _)| n == *s))
            .copied()
            .collect();
        let spares = &spares[..];
        let load_of = |n: &NodeId| reports.get(n).map_or(0.0, |r| r.load);
        let held = held_by_node(&leaves);
        let active = held
            .keys()
            .filter(|n| !self.cells[n].retiring)
            .count()
            .max(1);
        let avg_load = held.keys().map(load_of).sum::<f64>() / active as f64;
        let safety_bound = self.cfg.safety_bound_for(avg_load);
        let mut round = Round {
            layout: None,
            decisions: Vec::new(),
            avg_load,
            safety_bound,
        };

        // Retired cells with no area and no entity leave the tree once every node has the layout
        // where they hold nothing: removing them then moves no chunk.
        let empty: Vec<NodeId> = leaves
            .iter()
            .filter(|(n, r)| {
                held[n] == 1
                    && self.cells[n].retiring
                    && r.area() == 0
                    && reports.get(n).is_some_and(|r| r.entities == 0)
            })
            .map(|(n, _)| *n)
            .collect();
        let all_applied = leaves
            .iter()
            .all(|(n, _)| reports.get(n).is_some_and(|r| r.partition_epoch >= epoch));
        if !empty.is_empty() && leaves.len() > empty.len() && all_applied {
            for node in &empty {
                root = without_leaf(root, *node);
                self.cells.remove(node);
                round.decisions.push(Decision::CellDeleted { node: *node });
            }
            self.lines.clear();
            round.layout = Some(root.tree());
            return round;
        }

        if self
            .last_meta_ms
            .is_none_or(|t| now_ms >= t + self.cfg.meta_period_ms)
        {
            self.last_meta_ms = Some(now_ms);
            if let Some(d) = self.meta_balance(&mut root, &leaves, reports, spares, epoch) {
                let structural = matches!(
                    d,
                    Decision::CellAdded { .. } | Decision::CellReassigned { .. }
                );
                round.decisions.push(d);
                if structural {
                    self.lines.clear();
                    round.layout = Some(root.tree());
                    return round;
                }
            }
        }

        let world = World {
            epoch,
            reports,
            cells: &self.cells,
            held: &held,
        };
        let mut moved = false;
        let mut decisions = Vec::new();
        balance(
            &mut root,
            String::new(),
            &world,
            safety_bound,
            &mut self.lines,
            &self.cfg,
            &mut decisions,
            &mut moved,
        );
        round.decisions.extend(decisions);
        if moved {
            round.layout = Some(root.tree());
        }
        round
    }

    /// BigWorld's meta balance: a cell more for an overloaded world when a spare node exists
    /// (or a retirement called off), a cell fewer for an idle one.
    fn meta_balance(
        &mut self,
        root: &mut Node,
        leaves: &[(NodeId, ChunkRect)],
        reports: &BTreeMap<NodeId, CellReport>,
        spares: &[NodeId],
        epoch: u64,
    ) -> Option<Decision> {
        let load_of = |n: &NodeId| reports.get(n).map_or(0.0, |r| r.load);
        let held = held_by_node(leaves);
        // A spare first restores one cell per node after a failover gave a node a second one:
        // it takes the smaller (fewer chunks change hands).
        if let Some(&spare) = spares.iter().min() {
            let second = leaves
                .iter()
                .filter(|(n, _)| held[n] > 1)
                .min_by_key(|(n, r)| (r.area(), *n));
            if let Some(&(from, rect)) = second {
                *root = with_leaf_given(std::mem::replace(root, placeholder()), from, rect, spare);
                self.cells.insert(
                    spare,
                    CellState {
                        since_epoch: epoch + 1,
                        retiring: false,
                    },
                );
                return Some(Decision::CellReassigned { node: spare, from });
            }
        }
        let total: f64 = held.keys().map(load_of).sum();
        let active: Vec<NodeId> = held
            .keys()
            .copied()
            .filter(|n| !self.cells[n].retiring)
            .collect();
        let cells_avg = total / active.len().max(1) as f64;
        let everyone_avg = (total + spares.iter().map(load_of).sum::<f64>())
            / (active.len() + spares.len()).max(1) as f64;
        // A retirement the world no longer affords is called off: the cells that stay would
        // average over the lower bound, by the tolerance (so that it does not flap).
        if cells_avg > self.cfg.lower_bound + self.cfg.add_tolerance {
            if let Some((node, state)) = self.cells.iter_mut().find(|(_, s)| s.retiring) {
                state.retiring = false;
                return Some(Decision::RetireCancelled { node: *node });
            }
        }
        if cells_avg > everyone_avg + self.cfg.add_tolerance && cells_avg >= self.cfg.add_above {
            if let Some((node, state)) = self.cells.iter_mut().find(|(_, s)| s.retiring) {
                state.retiring = false;
                return Some(Decision::RetireCancelled { node: *node });
            }
            let spare = *spares.iter().min()?;
            let (beside, rect) = leaves
                .iter()
                .filter(|(n, r)| {
                    held[n] == 1 && r.area() > 0 && self.cells[n].created(reports.get(n))
                })
                .max_by(|a, b| load_of(&a.0).total_cmp(&load_of(&b.0)).then(b.0.cmp(&a.0)))?;
            let axis = if rect.width() >= rect.height() {
                Axis::X
            } else {
                Axis::Y
            };
            let (_, edge) = range(rect, axis);
            *root = with_leaf_split(
                std::mem::replace(root, placeholder()),
                (*beside, *rect),
                axis,
                edge,
                spare,
            );
            self.cells.insert(
                spare,
                CellState {
                    since_epoch: epoch + 1,
                    retiring: false,
                },
            );
            return Some(Decision::CellAdded {
                node: spare,
                beside: *beside,
            });
        }
        if active.len() >= 2 && total / ((active.len() - 1) as f64) < self.cfg.lower_bound {
            let node = *active
                .iter()
                .filter(|n| held[*n] == 1)
                .min_by(|a, b| load_of(a).total_cmp(&load_of(b)).then(b.cmp(a)))?;
            self.cells.get_mut(&node)?.retiring = true;
            return Some(Decision::RetireStarted { node });
        }
        None
    }
}

fn placeholder() -> Node {
    Node::Leaf {
        node: 0,
        rect: ChunkRect::new(0, 0, 0, 0),
    }
}

/// How many leaves each node holds.
fn held_by_node(leaves: &[(NodeId, ChunkRect)]) -> BTreeMap<NodeId, usize> {
    let mut held = BTreeMap::new();
    for (n, _) in leaves {
        *held.entry(*n).or_insert(0) += 1;
    }
    held
}

/// `tree` with the leaf of `node` over `cell` given to `new`.
fn with_leaf_given(tree: Node, node: NodeId, cell: ChunkRect, new: NodeId) -> Node {
    match tree {
        Node::Leaf { node: n, rect } if n == node && rect == cell => Node::Leaf { node: new, rect },
        Node::Split {
            axis,
            at,
            rect,
            low,
            high,
        } => Node::Split {
            axis,
            at,
            rect,
            low: Box::new(with_leaf_given(*low, node, cell, new)),
            high: Box::new(with_leaf_given(*high, node, cell, new)),
        },
        leaf => leaf,
    }
}

/// `tree` with the leaf of `node` over `cell` split at `at` on `axis`: it keeps the low side,
/// `new` the high one.
fn with_leaf_split(
    tree: Node,
    (node, cell): (NodeId, ChunkRect),
    axis: Axis,
    at: i64,
    new: NodeId,
) -> Node {
    match tree {
        Node::Leaf { node: n, rect } if n == node && rect == cell => {
            let (l, h) = halves(&rect, axis, at);
            Node::Split {
                axis,
                at,
                rect,
                low: Box::new(Node::Leaf { node, rect: l }),
                high: Box::new(Node::Leaf { node: new, rect: h }),
            }
        }
        Node::Split {
            axis: a,
            at: p,
            rect,
            low,
            high,
        } => Node::Split {
            axis: a,
            at: p,
            rect,
            low: Box::new(with_leaf_split(*low, (node, cell), axis, at, new)),
            high: Box::new(with_leaf_split(*high, (node, cell), axis, at, new)),
        },
        leaf => leaf,
    }
}

/// `tree` without `node`'s leaf: its sibling takes the parent's place (and cell).
fn without_leaf(tree: Node, node: NodeId) -> Node {
    match tree {
        Node::Split {
            axis,
            at,
            rect,
            low,
            high,
        } => {
            let is = |n: &Node| matches!(n, Node::Leaf { node: m, .. } if *m == node);
            if is(&low) {
                let mut h = *high;
                h.set_rect(rect);
                h
            } else if is(&high) {
                let mut l = *low;
                l.set_rect(rect);
                l
            } else {
                Node::Split {
                    axis,
                    at,
                    rect,
                    low: Box::new(without_leaf(*low, node)),
                    high: Box::new(without_leaf(*high, node)),
                }
            }
        }
        leaf => leaf,
    }
}

/// Balances `node`'s line, then its children's within their new cells.
#[allow(clippy::too_many_arguments)]
fn balance(
    node: &mut Node,
    path: String,
    world: &World,
    safety_bound: f64,
    lines: &mut HashMap<String, LineState>,
    cfg: &LoadConfig,
    out: &mut Vec<Decision>,
    moved: &mut bool,
) {
    let Node::Split {
        axis,
        at,
        rect,
        low,
        high,
    } = node
    else {
        return;
    };
    let (axis, from) = (*axis, *at);
    let (l, h) = (low.sum(world), high.sum(world));
    let all = l.cells + h.cells - l.retiring - h.retiring;
    let node_avg = (l.load + h.load) / all.max(1) as f64;
    let (lo, hi) = range(rect, axis);
    // Room: up to the nearest parallel line inside each side (or its far edge).
    let mut inner = Vec::new();
    low.lines_on(axis, &mut inner);
    let low_room = from - inner.iter().copied().max().unwrap_or(lo).max(lo);
    inner.clear();
    high.lines_on(axis, &mut inner);
    let high_room = inner.iter().copied().min().unwrap_or(hi).min(hi) - from;
    fn side(s: &Sum, room: i64) -> Side<'_> {
        Side {
            avg_load: s.avg(),
            max_load: s.max_load,
            created: s.created,
            current: s.current,
            mapped: s.mapped,
            all_retiring: s.all_retiring,
            levels: &s.levels,
            ghost_chunks: s.ghost_chunks,
            room,
        }
    }
    let state = lines.entry(path.clone()).or_default();
    let d = do_balance(
        axis,
        &side(&l, low_room),
        &side(&h, high_room),
        node_avg,
        safety_bound,
        state,
        cfg,
    );
    let to = match d.shrink {
        Shrink::Low => from - d.by,
        Shrink::High => from + d.by,
        Shrink::None => from,
    };
    if to != from {
        *at = to;
        *moved = true;
        let (lr, hr) = halves(rect, axis, to);
        low.set_rect(lr);
        high.set_rect(hr);
    }
    out.push(Decision::Line {
        path: path.clone(),
        axis,
        from,
        to,
        line: d,
    });
    balance(
        low,
        format!("{path}l"),
        world,
        safety_bound,
        lines,
        cfg,
        out,
        moved,
    );
    balance(
        high,
        format!("{path}h"),
        world,
        safety_bound,
        lines,
        cfg,
        out,
        moved,
    );
}
