//! Entity bound levels (BigWorld's `EntityBoundLevels`): for each edge of a cell, how many
//! entities and how much load lie within each distance of it, a chunk at a time. A line moving
//! into a cell uses them to shed at most the load it means to: the deepest move whose entities
//! carry no more. BigWorld keeps a few load thresholds per edge; these keep every chunk depth up to
//! [`MAX_DEPTH`], which merges exactly from two children into their parent.

use serde::{Deserialize, Serialize};

use crate::geometry::{ChunkPos, ChunkRect};
use crate::partition::Axis;

/// Depths kept per edge, in chunks: past this no single move goes.
pub const MAX_DEPTH: usize = 64;

/// One edge of a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Edge {
    XLow,
    XHigh,
    YLow,
    YHigh,
}

impl Edge {
    /// The edge of the low or high side of a split on `axis` that faces the line.
    pub fn facing_line(axis: Axis, low_side: bool) -> Self {
        match (axis, low_side) {
            (Axis::X, true) => Edge::XHigh,
            (Axis::X, false) => Edge::XLow,
            (Axis::Y, true) => Edge::YHigh,
            (Axis::Y, false) => Edge::YLow,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What lies within `d + 1` chunks of one edge, for each `d`: cumulative.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Levels {
    pub entities: Vec<u32>,
    pub load: Vec<f64>,
}

impl Levels {
    fn with_depth(n: usize) -> Self {
        Self {
            entities: vec![0; n],
            load: vec![0.0; n],
        }
    }

    fn len(&self) -> usize {
        self.load.len()
    }

    /// Cumulative from per-depth sums.
    fn accumulate(&mut self) {
        for d in 1..self.len() {
            self.entities[d] += self.entities[d - 1];
            self.load[d] += self.load[d - 1];
        }
    }
}

/// A cell's entity bound levels, with its totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EntityBoundLevels {
    /// By [`Edge`]: x low, x high, y low, y high.
    pub edges: [Levels; 4],
    pub entities: u32,
    pub load: f64,
}

/// What lies within `d + 1` chunks of an edge: past the levels kept, the cell's totals.
fn at(levels: &Levels, d: usize, cell: &EntityBoundLevels) -> (u32, f64) {
    match (levels.entities.get(d), levels.load.get(d)) {
        (Some(e), Some(l)) => (*e, *l),
        _ => (cell.entities, cell.load),
    }
}

impl EntityBoundLevels {
    /// The levels of `rect` holding `entities` (chunk, count), each entity carrying
    /// `load_per_entity`; entities outside the rect are not counted.
    pub fn measure(
        rect: ChunkRect,
        entities: impl IntoIterator<Item = (ChunkPos, u32)>,
        load_per_entity: f64,
    ) -> Self {
        let depth = |extent: i64| (extent.max(0) as usize).min(MAX_DEPTH);
        let (dx, dy) = (depth(rect.width()), depth(rect.height()));
        let mut out = Self {
            edges: [
                Levels::with_depth(dx),
                Levels::with_depth(dx),
                Levels::with_depth(dy),
                Levels::with_depth(dy),
            ],
            entities: 0,
            load: 0.0,
        };
        for (c, n) in entities {
            if !rect.contains(c) {
                continue;
            }
            let load = f64::from(n) * load_per_entity;
            out.entities += n;
            out.load += load;
            let from_edge = [
                c.x - rect.x0,
                rect.x1 - 1 - c.x,
                c.y - rect.y0,
                rect.y1 - 1 - c.y,
            ];
            for (levels, d) in out.edges.iter_mut().zip(from_edge) {
                if let Some(slot) = usize::try_from(d).ok().filter(|&d| d < levels.len()) {
                    levels.entities[slot] += n;
                    levels.load[slot] += load;
                }
            }
        }
        for levels in &mut out.edges {
            levels.accumulate();
        }
        out
    }

    pub fn edge(&self, edge: Edge) -> &Levels {
        &self.edges[edge.index()]
    }

    /// The parent's levels from its children's, split on `axis`, the low child `low_width`
    /// chunks across that axis (the high child `high_width`). Exact up to [`MAX_DEPTH`].
    pub fn merge(low: &Self, high: &Self, axis: Axis, low_width: i64, high_width: i64) -> Self {
        let (along_low, along_high, across_low, across_high) = match axis {
            Axis::X => (Edge::XLow, Edge::XHigh, Edge::YLow, Edge::YHigh),
            Axis::Y => (Edge::YLow, Edge::YHigh, Edge::XLow, Edge::XHigh),
        };
        let depth = ((low_width + high_width).max(0) as usize).min(MAX_DEPTH);
        // Along the split axis: the near child's levels, then the near child whole and the far
        // child's levels past it.
        let chain = |near: &Self, near_edge: Edge, near_width: i64, far: &Self, far_edge: Edge| {
            let (n, f) = (near.edge(near_edge), far.edge(far_edge));
            let near_width = near_width.max(0) as usize;
            let mut out = Levels::with_depth(depth);
            for d in 0..depth {
                // Levels shorter than their cell (a report of another shape) count as full.
                let (e, l) = if d < near_width {
                    at(n, d, near)
                } else {
                    let (e, l) = at(f, d - near_width, far);
                    (near.entities + e, near.load + l)
                };
                out.entities[d] = e;
                out.load[d] = l;
            }
            out
        };
        // Across it: both children span the edge, so their levels add up.
        let sum = |edge: Edge| {
            let (a, b) = (low.edge(edge), high.edge(edge));
            let n = a.len().max(b.len());
            let mut out = Levels::with_depth(n);
            for d in 0..n {
                let ((ea, la), (eb, lb)) = (at(a, d, low), at(b, d, high));
                out.entities[d] = ea + eb;
                out.load[d] = la + lb;
            }
            out
        };
        let mut edges: [Levels; 4] = Default::default();
        edges[along_low.index()] = chain(low, along_low, low_width, high, along_low);
        edges[along_high.index()] = chain(high, along_high, high_width, low, along_high);
        edges[across_low.index()] = sum(across_low);
        edges[across_high.index()] = sum(across_high);
        Self {
            edges,
            entities: low.entities + high.entities,
            load: low.load + high.load,
        }
    }

    /// The deepest move from `edge`, in chunks, whose entities carry at most `load`.
    pub fn depth_for_load(&self, edge: Edge, load: f64) -> i64 {
        let levels = self.edge(edge);
        levels.load.iter().take_while(|&&l| l <= load).count() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(x: i64, y: i64) -> ChunkPos {
        ChunkPos { x, y }
    }

    #[test]
    fn levels_count_what_lies_within_each_depth_of_each_edge() {
        let rect = ChunkRect::new(0, 0, 4, 3);
        let l =
            EntityBoundLevels::measure(rect, [(at(0, 0), 2), (at(3, 1), 1), (at(9, 9), 5)], 0.1);
        assert_eq!((l.entities, (l.load * 10.0).round()), (3, 3.0));
        assert_eq!(l.edge(Edge::XLow).entities, [2, 2, 2, 3]);
        assert_eq!(l.edge(Edge::XHigh).entities, [1, 1, 1, 3]);
        assert_eq!(l.edge(Edge::YLow).entities, [2, 3, 3]);
        assert_eq!(l.edge(Edge::YHigh).entities, [0, 1, 3]);
        assert_eq!(
            l.depth_for_load(Edge::XLow, 0.15),
            0,
            "the first column carries 0.2"
        );
        assert_eq!(l.depth_for_load(Edge::XHigh, 0.15), 3);
        assert_eq!(l.depth_for_load(Edge::YHigh, 1.0), 3);
    }

    proptest::proptest! {
        /// Merging two children's levels gives what measuring their parent gives.
        #[test]
        fn merged_levels_are_the_parents_measured(
            w in 1i64..90, h in 1i64..90, cut in 0i64..90, along_x in proptest::bool::ANY,
            ents in proptest::collection::vec((0i64..90, 0i64..90, 1u32..4), 0..40),
        ) {
            let parent = ChunkRect::new(0, 0, w, h);
            let (axis, cut) = if along_x { (Axis::X, cut.min(w)) } else { (Axis::Y, cut.min(h)) };
            let (low, high) = match axis {
                Axis::X => (ChunkRect { x1: cut, ..parent }, ChunkRect { x0: cut, ..parent }),
                Axis::Y => (ChunkRect { y1: cut, ..parent }, ChunkRect { y0: cut, ..parent }),
            };
            let ents: Vec<(ChunkPos, u32)> = ents.iter().map(|&(x, y, n)| (at(x % w, y % h), n)).collect();
            let m = |r| EntityBoundLevels::measure(r, ents.iter().copied(), 0.25);
            let (lw, hw) = match axis {
                Axis::X => (low.width(), high.width()),
                Axis::Y => (low.height(), high.height()),
            };
            let merged = EntityBoundLevels::merge(&m(low), &m(high), axis, lw, hw);
            proptest::prop_assert_eq!(merged, m(parent));
        }
    }
}
