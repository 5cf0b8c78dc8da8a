//! The fixed grid: `cols × rows` equal regions of whole chunks and a region → node table.

use crate::geometry::{ChunkPos, ChunkRect, WorldShape};

use super::{NodeId, PartitionError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    cols: u32,
    rows: u32,
    /// Region size in chunks.
    region_w: i64,
    region_h: i64,
    /// Owner of region `(x, y)` at `y * cols + x`.
    table: Vec<NodeId>,
}

impl Grid {
    /// A `cols × rows` grid over `shape`'s world, `table` listing the owner of each region row by
    /// row (`y = 0` first). Every region must be a whole number of chunks.
    pub fn new(
        shape: &WorldShape,
        cols: u32,
        rows: u32,
        table: Vec<NodeId>,
    ) -> Result<Self, PartitionError> {
        shape.validate()?;
        let bad = |why: String| PartitionError::GridShape { cols, rows, why };
        if cols == 0 || rows == 0 {
            return Err(bad("a grid needs at least one region on each axis".into()));
        }
        let (cx, cy) = (shape.chunks_x(), shape.chunks_y());
        for (axis, n, chunks, metres) in [
            ("width", cols, cx, shape.width),
            ("height", rows, cy, shape.height),
        ] {
            if chunks % i64::from(n) != 0 {
                return Err(bad(format!(
                    "region {axis} would be {:.2} m = {chunks}/{n} chunks, not a whole number of {} m chunks",
                    metres / f64::from(n),
                    shape.chunk_size
                )));
            }
        }
        let expected = cols as usize * rows as usize;
        if table.len() != expected {
            return Err(PartitionError::TableSize {
                cols,
                rows,
                expected,
                got: table.len(),
            });
        }
        Ok(Self {
            cols,
            rows,
            region_w: cx / i64::from(cols),
            region_h: cy / i64::from(rows),
            table,
        })
    }

    /// A `cols × rows` grid shared by `nodes` in compact blocks: the grid is halved along its
    /// longer side (rows first on a square), each half going to half of the nodes, and so on.
    /// Blocks keep borders, and so ghost bands, short. With more nodes than regions, the last
    /// nodes of some halves own nothing.
    pub fn even(
        shape: &WorldShape,
        cols: u32,
        rows: u32,
        nodes: &[NodeId],
    ) -> Result<Self, PartitionError> {
        fn assign(
            table: &mut [NodeId],
            cols: u32,
            xs: (u32, u32),
            ys: (u32, u32),
            nodes: &[NodeId],
        ) {
            let (w, h) = (xs.1 - xs.0, ys.1 - ys.0);
            if nodes.len() == 1 || (w <= 1 && h <= 1) {
                for y in ys.0..ys.1 {
                    for x in xs.0..xs.1 {
                        table[(y * cols + x) as usize] = nodes[0];
                    }
                }
                return;
            }
            let (low, high) = nodes.split_at(nodes.len() / 2);
            // Regions in proportion to nodes, rounded to the nearest region.
            let share = |len: u32| {
                ((len as usize * low.len() * 2 + nodes.len()) / (nodes.len() * 2)) as u32
            };
            if w > h {
                let at = xs.0 + share(w);
                assign(table, cols, (xs.0, at), ys, low);
                assign(table, cols, (at, xs.1), ys, high);
            } else {
                let at = ys.0 + share(h);
                assign(table, cols, xs, (ys.0, at), low);
                assign(table, cols, xs, (at, ys.1), high);
            }
        }
        if nodes.is_empty() {
            return Err(PartitionError::NoNodes);
        }
        let mut table = vec![nodes[0]; cols as usize * rows as usize];
        assign(&mut table, cols, (0, cols), (0, rows), nodes);
        Self::new(shape, cols, rows, table)
    }

    pub fn cols(&self) -> u32 {
        self.cols
    }

    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// Owners of the regions, row by row.
    pub fn table(&self) -> &[NodeId] {
        &self.table
    }

    /// Size of one region in chunks.
    pub fn region_chunks(&self) -> (i64, i64) {
        (self.region_w, self.region_h)
    }

    pub(super) fn chunks(&self) -> (i64, i64) {
        (
            self.region_w * i64::from(self.cols),
            self.region_h * i64::from(self.rows),
        )
    }

    /// Owner of region `(x, y)`; both must be inside the grid.
    pub fn owner_of_region(&self, x: u32, y: u32) -> NodeId {
        self.table[y as usize * self.cols as usize + x as usize]
    }

    /// `c` must be normalised.
    pub(super) fn owner_of_chunk(&self, c: ChunkPos) -> NodeId {
        let x = (c.x / self.region_w) as usize;
        let y = (c.y / self.region_h) as usize;
        self.table[y * self.cols as usize + x]
    }

    pub fn region_rect(&self, x: u32, y: u32) -> ChunkRect {
        let (x, y) = (i64::from(x), i64::from(y));
        ChunkRect::new(
            x * self.region_w,
            y * self.region_h,
            (x + 1) * self.region_w,
            (y + 1) * self.region_h,
        )
    }

    pub(super) fn cells(&self) -> impl Iterator<Item = (ChunkRect, NodeId)> + '_ {
        self.table.iter().enumerate().map(|(i, &node)| {
            let (x, y) = (i as u32 % self.cols, i as u32 / self.cols);
            (self.region_rect(x, y), node)
        })
    }

    /// `node`'s regions, adjacent regions of one row merged into one rectangle.
    pub(super) fn area_of(&self, node: NodeId) -> Vec<ChunkRect> {
        let mut out = Vec::new();
        for (y, row) in self.table.chunks(self.cols as usize).enumerate() {
            let mut x = 0;
            while x < row.len() {
                if row[x] != node {
                    x += 1;
                    continue;
                }
                let start = x;
                while x < row.len() && row[x] == node {
                    x += 1;
                }
                let first = self.region_rect(start as u32, y as u32);
                let last = self.region_rect(x as u32 - 1, y as u32);
                out.push(ChunkRect::new(first.x0, first.y0, last.x1, last.y1));
            }
        }
        out
    }
}
