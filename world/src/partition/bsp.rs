//! The BSP layout (BigWorld's CellAppMgr, seed `004`): a binary tree of axis-aligned split lines
//! on chunk edges over `[0, chunks_x) × [0, chunks_y)`; each leaf is a cell owned by a node.
//!
//! A split at `at` on `x` sends chunks with `x < at` to its low child and the rest to its high
//! child. A line may sit on its cell's edge, leaving one child with no area: that is how a new
//! cell starts (zero width, then grown by moving the line) and how a retiring one ends.
//!
//! The tree lives in one vector in pre-order (a split's low child follows it), so a lookup is a
//! walk down one path with no allocation. Entries are addressed by their pre-order index, as
//! listed by [`Bsp::entries`]; every change rebuilds and re-validates the vector, so indices are
//! only meaningful for the tree they were read from.

use serde::{Deserialize, Serialize};

use crate::geometry::{ChunkPos, ChunkRect, WorldShape};

use super::{Grid, NodeId, PartitionError, MAX_BSP_DEPTH};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    X,
    Y,
}

impl std::fmt::Display for Axis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Axis::X => "x",
            Axis::Y => "y",
        })
    }
}

/// The nested form of a BSP, as stored and printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum BspTree {
    Leaf {
        node: NodeId,
    },
    Split {
        axis: Axis,
        at: i64,
        low: Box<BspTree>,
        high: Box<BspTree>,
    },
}

impl BspTree {
    pub fn leaf(node: NodeId) -> Self {
        BspTree::Leaf { node }
    }

    /// Every leaf's node, low before high; a cell with no area (just added, or squeezed out
    /// before its deletion) included.
    pub fn leaves(&self) -> Vec<NodeId> {
        fn walk(t: &BspTree, out: &mut Vec<NodeId>) {
            match t {
                BspTree::Leaf { node } => out.push(*node),
                BspTree::Split { low, high, .. } => {
                    walk(low, out);
                    walk(high, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(self, &mut out);
        out
    }

    pub fn split(axis: Axis, at: i64, low: BspTree, high: BspTree) -> Self {
        BspTree::Split {
            axis,
            at,
            low: Box::new(low),
            high: Box::new(high),
        }
    }

    /// The subtree at pre-order `target`, counting from `*index`.
    fn find_mut(&mut self, target: usize, index: &mut usize) -> Option<&mut BspTree> {
        if *index == target {
            return Some(self);
        }
        *index += 1;
        match self {
            BspTree::Leaf { .. } => None,
            BspTree::Split { low, high, .. } => {
                if let Some(found) = low.find_mut(target, index) {
                    return Some(found);
                }
                high.find_mut(target, index)
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Leaf {
        node: NodeId,
    },
    /// The low child is the next slot; `high` is the index of the high child.
    Split {
        axis: Axis,
        at: i64,
        high: u32,
    },
}

/// One entry of the tree, for display and for addressing changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BspEntry {
    pub index: usize,
    pub depth: usize,
    /// The cell this entry covers (for a split: the cell its line divides).
    pub rect: ChunkRect,
    pub kind: BspEntryKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BspEntryKind {
    Leaf { node: NodeId },
    Split { axis: Axis, at: i64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bsp {
    chunks_x: i64,
    chunks_y: i64,
    slots: Vec<Slot>,
    rects: Vec<ChunkRect>,
    depths: Vec<u8>,
}

/// A cell's extent along `axis`.
pub(crate) fn range(rect: &ChunkRect, axis: Axis) -> (i64, i64) {
    match axis {
        Axis::X => (rect.x0, rect.x1),
        Axis::Y => (rect.y0, rect.y1),
    }
}

/// A cell's two sides of a line at `at` on `axis`.
pub(crate) fn halves(rect: &ChunkRect, axis: Axis, at: i64) -> (ChunkRect, ChunkRect) {
    match axis {
        Axis::X => (ChunkRect { x1: at, ..*rect }, ChunkRect { x0: at, ..*rect }),
        Axis::Y => (ChunkRect { y1: at, ..*rect }, ChunkRect { y0: at, ..*rect }),
    }
}

impl Bsp {
    /// Builds and validates a tree over `shape`'s world: every line must lie within the cell it
    /// divides (edges included), so the leaves tile the world exactly.
    pub fn new(shape: &WorldShape, tree: &BspTree) -> Result<Self, PartitionError> {
        shape.validate()?;
        Self::build(shape.chunks_x(), shape.chunks_y(), tree)
    }

    fn build(chunks_x: i64, chunks_y: i64, tree: &BspTree) -> Result<Self, PartitionError> {
        let mut bsp = Bsp {
            chunks_x,
            chunks_y,
            slots: Vec::new(),
            rects: Vec::new(),
            depths: Vec::new(),
        };
        bsp.flatten(tree, ChunkRect::new(0, 0, chunks_x, chunks_y), 0)?;
        Ok(bsp)
    }

    fn flatten(
        &mut self,
        tree: &BspTree,
        rect: ChunkRect,
        depth: usize,
    ) -> Result<(), PartitionError> {
        if depth > MAX_BSP_DEPTH {
            return Err(PartitionError::TooDeep);
        }
        let index = self.slots.len();
        self.rects.push(rect);
        self.depths.push(depth as u8);
        match tree {
            BspTree::Leaf { node } => self.slots.push(Slot::Leaf { node: *node }),
            BspTree::Split {
                axis,
                at,
                low,
                high,
            } => {
                let (axis, at) = (*axis, *at);
                let (lo, hi) = range(&rect, axis);
                if !(lo..=hi).contains(&at) {
                    return Err(PartitionError::SplitOutside {
                        index,
                        axis,
                        at,
                        lo,
                        hi,
                    });
                }
                self.slots.push(Slot::Split { axis, at, high: 0 });
                let (low_rect, high_rect) = halves(&rect, axis, at);
                self.flatten(low, low_rect, depth + 1)?;
                let high_index = self.slots.len() as u32;
                self.slots[index] = Slot::Split {
                    axis,
                    at,
                    high: high_index,
                };
                self.flatten(high, high_rect, depth + 1)?;
            }
        }
        Ok(())
    }

    /// The nested form, as stored.
    pub fn tree(&self) -> BspTree {
        self.subtree(0)
    }

    fn subtree(&self, index: usize) -> BspTree {
        match self.slots[index] {
            Slot::Leaf { node } => BspTree::leaf(node),
            Slot::Split { axis, at, high } => BspTree::split(
                axis,
                at,
                self.subtree(index + 1),
                self.subtree(high as usize),
            ),
        }
    }

    /// The grid's regions as the leaves of a balanced tree, each owned as in the grid.
    pub fn from_grid(grid: &Grid) -> Result<Self, PartitionError> {
        fn build(grid: &Grid, xs: (u32, u32), ys: (u32, u32)) -> BspTree {
            let (rw, rh) = grid.region_chunks();
            if xs.1 - xs.0 >= ys.1 - ys.0 && xs.1 - xs.0 > 1 {
                let mid = (xs.0 + xs.1) / 2;
                let at = i64::from(mid) * rw;
                BspTree::split(
                    Axis::X,
                    at,
                    build(grid, (xs.0, mid), ys),
                    build(grid, (mid, xs.1), ys),
                )
            } else if ys.1 - ys.0 > 1 {
                let mid = (ys.0 + ys.1) / 2;
                let at = i64::from(mid) * rh;
                BspTree::split(
                    Axis::Y,
                    at,
                    build(grid, xs, (ys.0, mid)),
                    build(grid, xs, (mid, ys.1)),
                )
            } else {
                BspTree::leaf(grid.owner_of_region(xs.0, ys.0))
            }
        }
        let (cx, cy) = grid.chunks();
        Self::build(cx, cy, &build(grid, (0, grid.cols()), (0, grid.rows())))
    }

    /// One cell per node, made by halving the world along its longer side (rows first on a
    /// square), then each half, and so on: the starting point of a balancer.
    pub fn even(shape: &WorldShape, nodes: &[NodeId]) -> Result<Self, PartitionError> {
        fn build(rect: ChunkRect, nodes: &[NodeId]) -> BspTree {
            if let [node] = nodes {
                return BspTree::leaf(*node);
            }
            let k = nodes.len() / 2;
            let axis = if rect.width() > rect.height() {
                Axis::X
            } else {
                Axis::Y
            };
            let (lo, hi) = range(&rect, axis);
            let at = lo + (hi - lo) * k as i64 / nodes.len() as i64;
            let (low, high) = halves(&rect, axis, at);
            BspTree::split(axis, at, build(low, &nodes[..k]), build(high, &nodes[k..]))
        }
        shape.validate()?;
        if nodes.is_empty() {
            return Err(PartitionError::NoNodes);
        }
        Self::new(shape, &build(shape.world_rect(), nodes))
    }

    /// A tree whose leaves are exactly `cells`, which must tile the world: no cell empty or
    /// outside it, no two overlapping, no chunk left uncovered, and all separable by straight
    /// lines. The errors name the offending cells (by their index in `cells`) or chunk.
    pub fn from_cells(
        shape: &WorldShape,
        cells: &[(ChunkRect, NodeId)],
    ) -> Result<Self, PartitionError> {
        shape.validate()?;
        let world = shape.world_rect();
        let (chunks_x, chunks_y) = (world.x1, world.y1);
        for (index, (rect, _)) in cells.iter().enumerate() {
            if rect.is_empty() || rect.intersection(&world) != Some(*rect) {
                return Err(PartitionError::CellOutside {
                    index,
                    rect: *rect,
                    chunks_x,
                    chunks_y,
                });
            }
        }
        for (a, (rect_a, _)) in cells.iter().enumerate() {
            for (b, (rect_b, _)) in cells.iter().enumerate().skip(a + 1) {
                if let Some(both) = rect_a.intersection(rect_b) {
                    let chunk = ChunkPos {
                        x: both.x0,
                        y: both.y0,
                    };
                    return Err(PartitionError::Overlap {
                        a,
                        rect_a: *rect_a,
                        b,
                        rect_b: *rect_b,
                        chunk,
                    });
                }
            }
        }
        let covered: i64 = cells.iter().map(|(r, _)| r.area()).sum();
        if covered < world.area() {
            // The lowest uncovered chunk (by y, then x) has a covered chunk or the world's edge
            // to its left and below, so its coordinates are among the cells' far edges or 0.
            let xs = std::iter::once(0).chain(cells.iter().map(|(r, _)| r.x1));
            let ys: Vec<i64> = std::iter::once(0)
                .chain(cells.iter().map(|(r, _)| r.y1))
                .collect();
            let chunk = xs
                .flat_map(|x| ys.iter().map(move |&y| ChunkPos { x, y }))
                .filter(|&c| world.contains(c) && !cells.iter().any(|(r, _)| r.contains(c)))
                .min_by_key(|c| (c.y, c.x))
                .expect("a cover smaller than the world leaves a chunk uncovered");
            return Err(PartitionError::Uncovered { chunk });
        }
        let all: Vec<usize> = (0..cells.len()).collect();
        let tree = separate(cells, &all, world)?;
        Self::build(chunks_x, chunks_y, &tree)
    }

    pub(super) fn chunks(&self) -> (i64, i64) {
        (self.chunks_x, self.chunks_y)
    }

    /// `c` must be normalised.
    pub(super) fn owner_of_chunk(&self, c: ChunkPos) -> NodeId {
        let mut i = 0;
        loop {
            match self.slots[i] {
                Slot::Leaf { node } => return node,
                Slot::Split { axis, at, high } => {
                    let v = match axis {
                        Axis::X => c.x,
                        Axis::Y => c.y,
                    };
                    i = if v < at { i + 1 } else { high as usize };
                }
            }
        }
    }

    /// The leaves with area, and their owners.
    pub(super) fn cells(&self) -> impl Iterator<Item = (ChunkRect, NodeId)> + '_ {
        self.slots
            .iter()
            .zip(&self.rects)
            .filter_map(|(slot, rect)| match slot {
                Slot::Leaf { node } if !rect.is_empty() => Some((*rect, *node)),
                _ => None,
            })
    }

    /// Every entry in pre-order, zero-area leaves included.
    pub fn entries(&self) -> impl Iterator<Item = BspEntry> + '_ {
        (0..self.slots.len()).map(|index| BspEntry {
            index,
            depth: self.depths[index] as usize,
            rect: self.rects[index],
            kind: match self.slots[index] {
                Slot::Leaf { node } => BspEntryKind::Leaf { node },
                Slot::Split { axis, at, .. } => BspEntryKind::Split { axis, at },
            },
        })
    }

    /// Leaves, zero-area ones included.
    pub fn leaf_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| matches!(s, Slot::Leaf { .. }))
            .count()
    }

    /// Deepest leaf, the root being depth 0.
    pub fn depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0) as usize
    }

    fn leaf(&self, index: usize) -> Result<NodeId, PartitionError> {
        match self.slots.get(index) {
            Some(Slot::Leaf { node }) => Ok(*node),
            Some(Slot::Split { .. }) => Err(PartitionError::BadEntry {
                index,
                why: "is a split, not a cell",
            }),
            None => Err(PartitionError::BadEntry {
                index,
                why: "does not exist",
            }),
        }
    }

    /// Replaces the subtree at `index` by `f(subtree)` and rebuilds; `self` is untouched on error.
    fn rebuild(
        &mut self,
        index: usize,
        f: impl FnOnce(BspTree) -> BspTree,
    ) -> Result<(), PartitionError> {
        let mut tree = self.tree();
        let target = tree
            .find_mut(index, &mut 0)
            .expect("index checked by the caller");
        let old = std::mem::replace(target, BspTree::leaf(0));
        *target = f(old);
        *self = Self::build(self.chunks_x, self.chunks_y, &tree)?;
        Ok(())
    }

    /// Splits cell `index` by a line on `axis` at chunk edge `at` (within the cell, edges
    /// included): chunks below the line go to `low`, the rest to `high`.
    pub fn split(
        &mut self,
        index: usize,
        axis: Axis,
        at: i64,
        low: NodeId,
        high: NodeId,
    ) -> Result<(), PartitionError> {
        self.leaf(index)?;
        let (lo, hi) = range(&self.rects[index], axis);
        if !(lo..=hi).contains(&at) {
            return Err(PartitionError::LineOutOfRange {
                index,
                axis,
                at,
                lo,
                hi,
            });
        }
        self.rebuild(index, |_| {
            BspTree::split(axis, at, BspTree::leaf(low), BspTree::leaf(high))
        })
    }

    /// Moves the line of split `index` to `at`, within the cell it divides; lines inside it are
    /// not dragged along, so a move that would cross one is refused.
    pub fn move_line(&mut self, index: usize, at: i64) -> Result<(), PartitionError> {
        let axis = match self.slots.get(index) {
            Some(Slot::Split { axis, .. }) => *axis,
            Some(Slot::Leaf { .. }) => {
                return Err(PartitionError::BadEntry {
                    index,
                    why: "is a cell, not a split",
                })
            }
            None => {
                return Err(PartitionError::BadEntry {
                    index,
                    why: "does not exist",
                })
            }
        };
        let (lo, hi) = range(&self.rects[index], axis);
        if !(lo..=hi).contains(&at) {
            return Err(PartitionError::LineOutOfRange {
                index,
                axis,
                at,
                lo,
                hi,
            });
        }
        let result = self.rebuild(index, |t| match t {
            BspTree::Split {
                axis, low, high, ..
            } => BspTree::Split {
                axis,
                at,
                low,
                high,
            },
            leaf => leaf,
        });
        match result {
            Err(PartitionError::SplitOutside {
                index: inner,
                at: inner_at,
                ..
            }) => Err(PartitionError::WouldCross {
                index,
                at,
                inner,
                inner_at,
            }),
            other => other,
        }
    }

    /// Retires cell `index`: its split line goes, and the other side of that line takes its area.
    pub fn retire(&mut self, index: usize) -> Result<(), PartitionError> {
        self.leaf(index)?;
        if index == 0 {
            return Err(PartitionError::LastCell);
        }
        let parent = (0..index)
            .rev()
            .find(|&p| matches!(self.slots[p], Slot::Split { high, .. } if p + 1 == index || high as usize == index))
            .expect("every entry but the root has a parent before it");
        self.rebuild(parent, |t| match t {
            BspTree::Split { low, high, .. } => {
                if parent + 1 == index {
                    *high
                } else {
                    *low
                }
            }
            leaf => leaf,
        })
    }

    /// Hands cell `index` to `node`.
    pub fn assign(&mut self, index: usize, node: NodeId) -> Result<(), PartitionError> {
        self.leaf(index)?;
        self.slots[index] = Slot::Leaf { node };
        Ok(())
    }
}

/// A tree for `indices` (cells that tile `rect` exactly): cut `rect` by a line no cell crosses,
/// as near its middle as possible, and recurse.
fn separate(
    cells: &[(ChunkRect, NodeId)],
    indices: &[usize],
    rect: ChunkRect,
) -> Result<BspTree, PartitionError> {
    if let [only] = indices {
        return Ok(BspTree::leaf(cells[*only].1));
    }
    let mut best: Option<(i64, Axis, i64)> = None;
    for axis in [Axis::X, Axis::Y] {
        let (lo, hi) = range(&rect, axis);
        for &i in indices {
            let at = range(&cells[i].0, axis).1;
            if at >= hi {
                continue;
            }
            let uncut = indices.iter().all(|&j| {
                let (a, b) = range(&cells[j].0, axis);
                b <= at || a >= at
            });
            let off_centre = (2 * at - lo - hi).abs();
            if uncut && best.is_none_or(|(o, _, _)| off_centre < o) {
                best = Some((off_centre, axis, at));
            }
        }
    }
    let Some((_, axis, at)) = best else {
        return Err(PartitionError::NotSeparable {
            cells: indices.to_vec(),
        });
    };
    let (low_rect, high_rect) = halves(&rect, axis, at);
    let (low, high): (Vec<usize>, Vec<usize>) = indices
        .iter()
        .partition(|&&i| range(&cells[i].0, axis).1 <= at);
    Ok(BspTree::split(
        axis,
        at,
        separate(cells, &low, low_rect)?,
        separate(cells, &high, high_rect)?,
    ))
}
