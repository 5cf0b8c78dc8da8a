//! Who owns every point of the torus (docs/partition.md): a [`Partition`] maps each chunk to exactly one
//! node, and is versioned by a monotonic epoch. Authority is derived from position, never stored
//! per entity: `owner = partition.owner_of(position)`.
//!
//! Two layouts sit behind the one type:
//! - [`Grid`]: fixed regions and a region → node table, changed only by committing a new epoch.
//! - [`Bsp`]: a BSP tree of axis-aligned split lines on chunk edges whose leaves are cells owned
//!   by nodes; the balancer splits cells, moves lines and retires cells.
//!
//! Everything here is pure: no I/O, no clock. Lookups ([`Partition::owner_of`]) allocate nothing
//! and cost O(1) on a grid and O(depth) in a BSP.

pub(crate) mod bsp;
mod diff;
mod failover;
mod grid;
mod replan;

pub use bsp::{Axis, Bsp, BspEntry, BspEntryKind, BspTree};
pub use diff::Transfer;
pub use grid::Grid;

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::geometry::{ChunkOffset, ChunkPos, ChunkRect, GeometryError, Pos, WorldShape};

/// A node: one game server and its sidecar. The same number is the node part of the entity ids
/// it mints.
pub type NodeId = u32;

/// Deepest BSP accepted: far beyond any useful tree, shallow enough that recursion is safe.
pub const MAX_BSP_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    #[error("world: {0}")]
    World(#[from] GeometryError),
    #[error("grid {cols}×{rows}: {why}")]
    GridShape { cols: u32, rows: u32, why: String },
    #[error("grid {cols}×{rows} needs a table of {expected} nodes (one per region, row by row), got {got}")]
    TableSize {
        cols: u32,
        rows: u32,
        expected: usize,
        got: usize,
    },
    #[error("{place} names node {node}, which is not one of the known nodes {known:?}")]
    UnknownNode {
        node: NodeId,
        place: String,
        known: Vec<NodeId>,
    },
    #[error("no nodes to own the world")]
    NoNodes,
    #[error(
        "layout is for a world of {layout_x}×{layout_y} chunks, the world has {world_x}×{world_y}"
    )]
    LayoutMismatch {
        layout_x: i64,
        layout_y: i64,
        world_x: i64,
        world_y: i64,
    },
    #[error(
        "split #{index} on {axis} at chunk {at} lies outside its cell {axis}∈[{lo}, {hi}): its \
         children would overlap a neighbouring cell and leave part of their own uncovered"
    )]
    SplitOutside {
        index: usize,
        axis: Axis,
        at: i64,
        lo: i64,
        hi: i64,
    },
    #[error("BSP deeper than {MAX_BSP_DEPTH} levels")]
    TooDeep,
    #[error(
        "cell {index} {rect} is empty or reaches outside the world of {chunks_x}×{chunks_y} chunks"
    )]
    CellOutside {
        index: usize,
        rect: ChunkRect,
        chunks_x: i64,
        chunks_y: i64,
    },
    #[error("cells {a} {rect_a} and {b} {rect_b} overlap (both cover chunk ({}, {}))", .chunk.x, .chunk.y)]
    Overlap {
        a: usize,
        rect_a: ChunkRect,
        b: usize,
        rect_b: ChunkRect,
        chunk: ChunkPos,
    },
    #[error("chunk ({}, {}) is covered by no cell", .chunk.x, .chunk.y)]
    Uncovered { chunk: ChunkPos },
    #[error("cells {cells:?} cannot be separated by straight split lines (they interlock)")]
    NotSeparable { cells: Vec<usize> },
    #[error("BSP entry #{index} {why}")]
    BadEntry { index: usize, why: &'static str },
    #[error("a line on {axis} through #{index} must lie within [{lo}, {hi}], not at {at}")]
    LineOutOfRange {
        index: usize,
        axis: Axis,
        at: i64,
        lo: i64,
        hi: i64,
    },
    #[error("moving split #{index} to {at} would cross split #{inner} at {inner_at}: move that line first")]
    WouldCross {
        index: usize,
        at: i64,
        inner: usize,
        inner_at: i64,
    },
    #[error("cannot retire the only cell: the world needs an owner")]
    LastCell,
    #[error("partitions of different worlds cannot be compared: {old:?} vs {new:?}")]
    WorldsDiffer { old: WorldShape, new: WorldShape },
    #[error("the partition is a {actual}, not a {wanted}")]
    WrongLayout {
        wanted: &'static str,
        actual: &'static str,
    },
}

/// The region → node assignment, grid or BSP.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    Grid(Grid),
    Bsp(Bsp),
}

impl Layout {
    pub fn kind(&self) -> &'static str {
        match self {
            Layout::Grid(_) => "grid",
            Layout::Bsp(_) => "bsp",
        }
    }

    fn chunks(&self) -> (i64, i64) {
        match self {
            Layout::Grid(g) => g.chunks(),
            Layout::Bsp(b) => b.chunks(),
        }
    }
}

/// One epoch of the partition of one world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PartitionSpec", into = "PartitionSpec")]
pub struct Partition {
    epoch: u64,
    shape: WorldShape,
    layout: Layout,
    /// The world in chunks, from `shape`: kept at hand for lookups.
    chunks: (i64, i64),
}

/// A foreign area near a node's own: the node that owns it, and the translation (by whole worlds)
/// that puts it next to ours. The same node can come back with several offsets, and a node can
/// be its own neighbour across a seam.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Neighbour {
    pub node: NodeId,
    pub offset: ChunkOffset,
}

impl Partition {
    /// Checks that `layout` was built for `shape`'s world.
    pub fn new(shape: WorldShape, epoch: u64, layout: Layout) -> Result<Self, PartitionError> {
        shape.validate()?;
        let (layout_x, layout_y) = layout.chunks();
        let (world_x, world_y) = (shape.chunks_x(), shape.chunks_y());
        if (layout_x, layout_y) != (world_x, world_y) {
            return Err(PartitionError::LayoutMismatch {
                layout_x,
                layout_y,
                world_x,
                world_y,
            });
        }
        Ok(Self {
            epoch,
            shape,
            layout,
            chunks: (world_x, world_y),
        })
    }

    /// A world's region grid, every region owned by `node`, at epoch 0: what a lone node runs
    /// with before any epoch is committed.
    pub fn single(shape: WorldShape, node: NodeId) -> Result<Self, PartitionError> {
        shape.validate()?;
        let (cols, rows) = (shape.regions_x() as u32, shape.regions_y() as u32);
        let grid = Grid::even(&shape, cols, rows, &[node])?;
        Self::new(shape, 0, Layout::Grid(grid))
    }

    /// The next epoch: `layout` with this partition's world and `epoch + 1`.
    pub fn successor(&self, layout: Layout) -> Result<Self, PartitionError> {
        Self::new(self.shape, self.epoch.saturating_add(1), layout)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn shape(&self) -> &WorldShape {
        &self.shape
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The grid layout, or an error naming the actual layout.
    pub fn grid(&self) -> Result<&Grid, PartitionError> {
        match &self.layout {
            Layout::Grid(g) => Ok(g),
            other => Err(PartitionError::WrongLayout {
                wanted: "grid",
                actual: other.kind(),
            }),
        }
    }

    /// The BSP layout, or an error naming the actual layout.
    pub fn bsp(&self) -> Result<&Bsp, PartitionError> {
        match &self.layout {
            Layout::Bsp(b) => Ok(b),
            other => Err(PartitionError::WrongLayout {
                wanted: "bsp",
                actual: other.kind(),
            }),
        }
    }

    /// The owner of a position anywhere on (or far outside) the torus; NaN and infinities are
    /// refused. Allocation-free: O(1) on a grid, O(depth) in a BSP.
    pub fn owner_of(&self, pos: Pos) -> Result<NodeId, GeometryError> {
        let p = self.shape.checked_normalise(pos)?;
        let size = self.shape.chunk_size;
        // `p` is on the world, so truncation is the floor; `min` guards the last chunk against
        // rounding up.
        let c = ChunkPos {
            x: ((p.x / size) as i64).min(self.chunks.0 - 1),
            y: ((p.y / size) as i64).min(self.chunks.1 - 1),
        };
        Ok(self.owner_of_normalised(c))
    }

    /// The owner of a chunk (normalised first).
    pub fn owner_of_chunk(&self, chunk: ChunkPos) -> NodeId {
        let c = ChunkPos {
            x: chunk.x.rem_euclid(self.chunks.0),
            y: chunk.y.rem_euclid(self.chunks.1),
        };
        self.owner_of_normalised(c)
    }

    fn owner_of_normalised(&self, c: ChunkPos) -> NodeId {
        match &self.layout {
            Layout::Grid(g) => g.owner_of_chunk(c),
            Layout::Bsp(b) => b.owner_of_chunk(c),
        }
    }

    /// Every non-empty cell with its owner. The cells tile the world exactly.
    pub fn cells(&self) -> Box<dyn Iterator<Item = (ChunkRect, NodeId)> + '_> {
        match &self.layout {
            Layout::Grid(g) => Box::new(g.cells()),
            Layout::Bsp(b) => Box::new(b.cells()),
        }
    }

    /// The nodes that own at least one chunk, ascending.
    pub fn nodes(&self) -> Vec<NodeId> {
        let set: BTreeSet<NodeId> = self.cells().map(|(_, n)| n).collect();
        set.into_iter().collect()
    }

    /// The nodes that hold a cell of the layout, ascending: those of [`nodes`](Self::nodes),
    /// and those of a BSP's cells with no area (just added, or retiring before deletion).
    pub fn members(&self) -> Vec<NodeId> {
        let set: BTreeSet<NodeId> = match &self.layout {
            Layout::Grid(g) => g.table().iter().copied().collect(),
            Layout::Bsp(b) => b.tree().leaves().into_iter().collect(),
        };
        set.into_iter().collect()
    }

    /// The area `node` owns, as disjoint rectangles; empty if it owns nothing.
    pub fn area_of(&self, node: NodeId) -> Vec<ChunkRect> {
        match &self.layout {
            Layout::Grid(g) => g.area_of(node),
            Layout::Bsp(b) => b
                .cells()
                .filter(|&(_, n)| n == node)
                .map(|(r, _)| r)
                .collect(),
        }
    }

    /// Chunks owned by `node`.
    pub fn chunks_of(&self, node: NodeId) -> i64 {
        self.cells()
            .filter(|&(_, n)| n == node)
            .map(|(r, _)| r.area())
            .sum()
    }

    /// The foreign areas within `radius` chunks (Chebyshev, so `1` finds the areas that touch) of
    /// `node`'s area, as `(node, offset)` pairs, sorted. "Foreign" is every area except `node`'s
    /// own at offset zero: `node` itself comes back when its area meets itself across a seam.
    pub fn neighbours(&self, node: NodeId, radius: u32) -> Result<Vec<Neighbour>, GeometryError> {
        let mine = self.area_of(node);
        self.near_rects(&mine, node, radius)
    }

    /// The areas within `radius` chunks of one chunk, except its owner's at offset zero: the
    /// nodes that must know about an entity standing there, and how to shift its position for
    /// each.
    pub fn near(&self, chunk: ChunkPos, radius: u32) -> Result<Vec<Neighbour>, GeometryError> {
        let c = self.shape.normalise_chunk(chunk);
        let here = [ChunkRect::new(c.x, c.y, c.x + 1, c.y + 1)];
        self.near_rects(&here, self.owner_of_chunk(c), radius)
    }

    fn near_rects(
        &self,
        mine: &[ChunkRect],
        me: NodeId,
        radius: u32,
    ) -> Result<Vec<Neighbour>, GeometryError> {
        let mut found = BTreeSet::new();
        for (theirs, node) in self.cells() {
            for a in mine {
                for offset in self
                    .shape
                    .rect_offsets_within(a, &theirs, i64::from(radius))?
                {
                    if node != me || offset != ChunkOffset::default() {
                        found.insert(Neighbour { node, offset });
                    }
                }
            }
        }
        Ok(found.into_iter().collect())
    }

    /// Refuses a layout that names a node outside `known` (e.g. the nodes an operator listed, or
    /// those with a record in the topology store); the error names the region or cell.
    pub fn check_nodes(&self, known: &[NodeId]) -> Result<(), PartitionError> {
        let unknown = |node: NodeId, place: String| PartitionError::UnknownNode {
            node,
            place,
            known: known.to_vec(),
        };
        match &self.layout {
            Layout::Grid(g) => {
                for (i, &node) in g.table().iter().enumerate() {
                    if !known.contains(&node) {
                        let (x, y) = (i as u32 % g.cols(), i as u32 / g.cols());
                        return Err(unknown(node, format!("region ({x}, {y})")));
                    }
                }
            }
            Layout::Bsp(b) => {
                for e in b.entries() {
                    if let BspEntryKind::Leaf { node } = e.kind {
                        if !known.contains(&node) {
                            return Err(unknown(node, format!("cell #{} {}", e.index, e.rect)));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The chunks that change hands going from `self` to `next`, as disjoint rectangles with
    /// their old and new owner; empty if both assign every chunk alike (whatever their epochs
    /// and layouts).
    pub fn diff(&self, next: &Partition) -> Result<Vec<Transfer>, PartitionError> {
        diff::diff(self, next)
    }
}

/// The stored and printed form of a partition; every field is validated on the way in.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PartitionSpec {
    epoch: u64,
    world: WorldShape,
    layout: LayoutSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum LayoutSpec {
    Grid {
        cols: u32,
        rows: u32,
        table: Vec<NodeId>,
    },
    Bsp {
        root: BspTree,
    },
}

impl TryFrom<PartitionSpec> for Partition {
    type Error = PartitionError;

    fn try_from(spec: PartitionSpec) -> Result<Self, PartitionError> {
        spec.world.validate()?;
        let layout = match spec.layout {
            LayoutSpec::Grid { cols, rows, table } => {
                Layout::Grid(Grid::new(&spec.world, cols, rows, table)?)
            }
            LayoutSpec::Bsp { root } => Layout::Bsp(Bsp::new(&spec.world, &root)?),
        };
        Partition::new(spec.world, spec.epoch, layout)
    }
}

impl From<Partition> for PartitionSpec {
    fn from(p: Partition) -> Self {
        let layout = match &p.layout {
            Layout::Grid(g) => LayoutSpec::Grid {
                cols: g.cols(),
                rows: g.rows(),
                table: g.table().to_vec(),
            },
            Layout::Bsp(b) => LayoutSpec::Bsp { root: b.tree() },
        };
        PartitionSpec {
            epoch: p.epoch,
            world: p.shape,
            layout,
        }
    }
}
